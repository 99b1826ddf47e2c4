"""Command-line helpers shared by every package's commands (zend.cli assembles them)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator


class LazyChoices:
    """argparse `choices` read on first use (checking a value, the subcommand's --help), not when the
    parser is built: scheme and dtype names live in modules that import torch.

    Give the argument a `metavar` too: without one, argparse lists the choices while adding it.
    """

    def __init__(self, load: Callable[[], Iterable[str]]) -> None:
        self._load = load
        self._names: tuple[str, ...] | None = None

    def _loaded(self) -> tuple[str, ...]:
        if self._names is None:
            self._names = tuple(self._load())
        return self._names

    def __contains__(self, value: object) -> bool:
        return value in self._loaded()

    def __iter__(self) -> Iterator[str]:
        return iter(self._loaded())

    def __len__(self) -> int:
        return len(self._loaded())
