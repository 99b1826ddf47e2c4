"""Build deploy/grafana/zen-dashboard.json, the zend Grafana dashboard, with grafana-foundation-sdk.

The JSON is generated, never edited by hand: change this file and run

    python deploy/grafana/build_dashboard.py          # rewrite the JSON
    python deploy/grafana/build_dashboard.py --check  # exit 1 when the JSON is stale

tests/deploy/test_observability.py checks the committed JSON is current, that every query in it
returns data from real daemons through a real Prometheus, and that it round-trips through the
SDK's dashboard model (Grafana's schema for the Grafana release the SDK is generated for).

Every query takes the data source from the `DS_PROMETHEUS` variable and filters by the `job`
and `instance` variables (per-tensor panels also by `zen_job`); rates use `$__rate_interval`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from grafana_foundation_sdk.builders import common as cb
from grafana_foundation_sdk.builders import dashboard as db
from grafana_foundation_sdk.builders import stat, statetimeline, table, timeseries
from grafana_foundation_sdk.builders.prometheus import Dataquery
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models import dashboard as dm
from grafana_foundation_sdk.models.prometheus import PromQueryFormat

OUTPUT = Path(__file__).resolve().parent / "zen-dashboard.json"
UID = "zen-sync"
DS = dm.DataSourceRef(type_val="prometheus", uid="${DS_PROMETHEUS}")

# Label filters shared by every query.
NODE = 'job=~"$job", instance=~"$instance"'
TENSOR = NODE + ', zen_job=~"$zen_job"'
RATE = "$__rate_interval"


def sel(metric: str, labels: str = NODE, extra: str = "") -> str:
    """`metric{labels[, extra]}`."""
    return f"{metric}{{{labels}{', ' + extra if extra else ''}}}"


def query(expr: str, legend: str = "__auto", ref: str = "A", instant: bool = False) -> Dataquery:
    q = Dataquery().expr(expr).legend_format(legend).ref_id(ref).datasource(DS)
    return q.instant().format(PromQueryFormat.TABLE) if instant else q.range()


def legend(calcs: list[str] | None = None) -> cb.VizLegendOptions:
    out = cb.VizLegendOptions().display_mode(common.LegendDisplayMode.TABLE if calcs else common.LegendDisplayMode.LIST)
    out = out.placement(common.LegendPlacement.BOTTOM).show_legend(True)
    return out.calcs(calcs) if calcs else out


def series(pid: int, title: str, description: str, unit: str, targets: list[Dataquery], width: int = 12,
           height: int = 8, calcs: list[str] | None = None) -> timeseries.Panel:
    p = (timeseries.Panel().id(pid).title(title).description(description).datasource(DS).unit(unit)
         .span(width).height(height).legend(legend(calcs))
         .tooltip(cb.VizTooltipOptions().mode(common.TooltipDisplayMode.MULTI).sort(common.SortOrder.DESCENDING))
         .fill_opacity(10).line_width(1).show_points(common.VisibilityMode.NEVER))
    for t in targets:
        p = p.with_target(t)
    return p


def single(pid: int, title: str, description: str, unit: str, target: Dataquery, steps: list[dm.Threshold],
           width: int = 4, decimals: float | None = None) -> stat.Panel:
    p = (stat.Panel().id(pid).title(title).description(description).datasource(DS).unit(unit).span(width).height(4)
         .with_target(target)
         .reduce_options(cb.ReduceDataOptions().calcs(["lastNotNull"]).values(False))
         .graph_mode(common.BigValueGraphMode.AREA).color_mode(common.BigValueColorMode.VALUE)
         .thresholds(db.ThresholdsConfig().mode(dm.ThresholdsMode.ABSOLUTE).steps(steps)))
    return p.decimals(decimals) if decimals is not None else p


def green_then(*steps: tuple[float, str]) -> list[dm.Threshold]:
    return [dm.Threshold(value=None, color="green"), *(dm.Threshold(value=v, color=c) for v, c in steps)]


def p_by_phase(q: float) -> str:
    return (f"histogram_quantile({q}, sum by (le, phase) "
            f"(rate({sel('zen_sync_duration_seconds_bucket')}[{RATE}])))")


def per_tensor(metric: str) -> str:
    # Imbalance, density and scheme are cluster-wide facts every node reports alike: one series per tensor.
    return f"max by (zen_job, tensor) ({sel(metric, TENSOR)})"


def tensor_series(pid: int, title: str, description: str, unit: str, metric: str) -> timeseries.Panel:
    """One series per tensor of a cluster-wide per-tensor gauge."""
    return series(pid, title, description, unit, [query(per_tensor(metric), "{{zen_job}}/{{tensor}}")], width=8)


def node_series(pid: int, title: str, description: str, unit: str, metric: str, width: int = 8) -> timeseries.Panel:
    """One series per daemon of a per-node gauge."""
    return series(pid, title, description, unit, [query(sel(metric), "{{instance}}")], width=width)


def build() -> db.Dashboard:
    d = (db.Dashboard("zen: sparse gradient sync").uid(UID)
         .description("zend daemons: sync time by phase, bytes on the wire against a dense allreduce, load "
                      "imbalance, density, scheme choice, errors and peer health.")
         .tags(["zen", "zend"]).editable().tooltip(dm.DashboardCursorSync.CROSSHAIR)
         .time("now-1h", "now").refresh("30s").timezone("browser")
         .with_variable(db.DatasourceVariable("DS_PROMETHEUS").label("Data source").type("prometheus"))
         .with_variable(db.QueryVariable("job").label("Scrape job").datasource(DS)
                        .query("label_values(zen_node_info, job)").refresh(dm.VariableRefresh.ON_TIME_RANGE_CHANGED)
                        # no custom "all" value: All is the zend jobs alone, so `up{job=~"$job"}` is the daemons'
                        .sort(dm.VariableSort.ALPHABETICAL_ASC).multi(True).include_all(True))
         .with_variable(db.QueryVariable("instance").label("Daemon").datasource(DS)
                        .query('label_values(zen_node_info{job=~"$job"}, instance)')
                        .refresh(dm.VariableRefresh.ON_TIME_RANGE_CHANGED)
                        .sort(dm.VariableSort.ALPHABETICAL_ASC).multi(True).include_all(True).all_value(".*"))
         .with_variable(db.QueryVariable("zen_job").label("Training job").datasource(DS)
                        .query('label_values(zen_tensor_input_rows{job=~"$job", instance=~"$instance"}, zen_job)')
                        .refresh(dm.VariableRefresh.ON_TIME_RANGE_CHANGED)
                        .sort(dm.VariableSort.ALPHABETICAL_ASC).multi(True).include_all(True).all_value(".*")))

    # Overview: one number each.
    d = d.with_row(db.Row("Overview").id(100))
    d = d.with_panel(single(
        1, "Tensor-steps / s", "Tensor-steps synchronised per second (one per tensor and step: a DDP step of k "
        "buckets counts k), all daemons and schemes.", "ops",
        query(f"sum(rate({sel('zen_tensor_steps_total')}[{RATE}]))"), green_then()))
    d = d.with_panel(single(
        2, "Step time p99", "99th percentile of a trainer's step in its daemon, from submit to result delivered.",
        "s", query(f"histogram_quantile(0.99, sum by (le) (rate({sel('zen_step_duration_seconds_bucket')}[{RATE}])))"),
        green_then((0.5, "orange"), (2, "red"))))
    d = d.with_panel(single(
        3, "Saved vs dense", "Share of the bytes a dense ring allreduce would have sent that zen did not send, "
        "over the dashboard's time range.", "percentunit",
        query(f"sum(increase({sel('zen_saved_bytes_total')}[$__range])) / "
              f"sum(increase({sel('zen_dense_equivalent_bytes_total')}[$__range]))"),
        [dm.Threshold(value=None, color="red"), dm.Threshold(value=0, color="orange"),
         dm.Threshold(value=0.5, color="green")], decimals=1))
    d = d.with_panel(single(
        4, "Daemons up", "Daemons Prometheus scraped successfully at the last scrape.", "none",
        query(f"sum({sel('up')})"), [dm.Threshold(value=None, color="red"), dm.Threshold(value=1, color="green")]))
    d = d.with_panel(single(
        5, "Peer links down", "Data-plane links to peers that are down, counted from every daemon's side.", "none",
        query(f"sum(1 - {sel('zen_peer_up')})"), green_then((1, "red"))))
    d = d.with_panel(single(
        6, "Errors / s", "Failed requests and steps per second, all codes.", "ops",
        query(f"sum(rate({sel('zen_errors_total')}[{RATE}]))"), green_then((0.001, "red")), decimals=3))

    d = d.with_row(db.Row("Sync time").id(101))
    d = d.with_panel(series(
        10, "Sync time by phase (p50, p99)",
        "Quantiles of one step's time on a node, per phase: wait (for the node's trainers), local_sum, "
        "agree, exchange, commit and deliver (they add up to the step).", "s",
        [query(p_by_phase(0.5), "p50 {{phase}}", "A"), query(p_by_phase(0.99), "p99 {{phase}}", "B")],
        calcs=["mean", "max", "lastNotNull"]))
    d = d.with_panel(series(
        11, "Mean step time, by daemon", "A trainer's step in its daemon (submit to result delivered), mean over "
        "the interval.", "s",
        [query(f"sum by (instance) (rate({sel('zen_step_duration_seconds_sum')}[{RATE}]))"
               f" / sum by (instance) (rate({sel('zen_step_duration_seconds_count')}[{RATE}]))",
               "{{instance}}")], width=6))
    d = d.with_panel(series(
        12, "Tensor-steps / s by scheme", "Tensor-steps synchronised per second, by the scheme that ran them.",
        "ops", [query(f"sum by (scheme) (rate({sel('zen_tensor_steps_total')}[{RATE}]))", "{{scheme}}")], width=6))

    d = d.with_row(db.Row("Bytes on the wire").id(102))
    d = d.with_panel(series(
        20, "Bytes on the wire vs dense equivalent",
        "Data-plane payload bytes per second, against what a dense ring allreduce would send for the same "
        "steps.", "Bps",
        [query(f"sum(rate({sel('zen_sent_bytes_total')}[{RATE}]))", "sent", "A"),
         query(f"sum(rate({sel('zen_received_bytes_total')}[{RATE}]))", "received", "B"),
         query(f"sum(rate({sel('zen_dense_equivalent_bytes_total')}[{RATE}]))", "dense equivalent", "C"),
         query(f"sum(rate({sel('zen_saved_bytes_total')}[{RATE}]))", "saved", "D")],
        calcs=["mean", "max"]))
    d = d.with_panel(series(
        21, "Sent by peer", "Payload bytes per second each daemon sends to each peer node.", "Bps",
        [query(f"sum by (instance, peer) (rate({sel('zen_sent_bytes_total')}[{RATE}]))",
               "{{instance}} → node {{peer}}")]))

    d = d.with_row(db.Row("Per tensor").id(103))
    d = d.with_panel(tensor_series(
        30, "Push imbalance", "Cluster push load imbalance at each tensor's last step (max / mean; 1 = even).",
        "x", "zen_push_imbalance"))
    d = d.with_panel(tensor_series(
        31, "Pull imbalance", "Cluster pull imbalance at each tensor's last step (max / mean; 1 = even).",
        "x", "zen_pull_imbalance"))
    d = d.with_panel(tensor_series(
        32, "Densification", "Non-zero rows of the sum / mean non-zero rows contributed per node.", "x",
        "zen_tensor_densification"))
    d = d.with_panel(tensor_series(
        33, "Density", "Non-zero rows of the summed gradient / rows.", "percentunit", "zen_tensor_density"))
    d = d.with_panel(series(
        34, "Rows in and out", "Non-zero rows the daemons contributed (summed over daemons) and rows of the sum.",
        "short",
        [query(f"sum by (zen_job, tensor) ({sel('zen_tensor_input_rows', TENSOR)})", "in {{zen_job}}/{{tensor}}",
               "A"),
         query(per_tensor("zen_tensor_output_rows"), "out {{zen_job}}/{{tensor}}", "B")], width=8))
    d = d.with_panel(
        table.Panel().id(35).title("Scheme chosen").datasource(DS).span(8).height(8)
        .description("The scheme each tensor used at its last step.")
        .with_target(query(f"max by (zen_job, tensor, scheme) ({sel('zen_scheme_chosen', TENSOR)} == 1)",
                           ref="A", instant=True))
        .with_transformation(dm.DataTransformerConfig(
            id_val="organize", options={"excludeByName": {"Time": True, "Value": True},
                                        "renameByName": {"zen_job": "job"}}))
        .sort_by([cb.TableSortByFieldState().display_name("tensor")])
        .cell_height(common.TableCellHeight.SM))

    d = d.with_row(db.Row("Errors and health").id(104))
    d = d.with_panel(series(
        40, "Errors by code", "Failed requests and steps per second, by gRPC status code.", "ops",
        [query(f"sum by (code) (rate({sel('zen_errors_total')}[{RATE}]))", "{{code}}")], width=8))
    d = d.with_panel(
        statetimeline.Panel().id(41).title("Peer links").datasource(DS).span(16).height(8)
        .description("Each daemon's data-plane link to each peer node.")
        .with_target(query(f"max by (instance, peer) ({sel('zen_peer_up')})", "{{instance}} → node {{peer}}"))
        .mappings([dm.ValueMap(options={"0": dm.ValueMappingResult(text="down", color="red", index=0),
                                        "1": dm.ValueMappingResult(text="up", color="green", index=1)})])
        .show_value(common.VisibilityMode.NEVER).merge_values(True).row_height(0.9).fill_opacity(70).line_width(0)
        .legend(cb.VizLegendOptions().show_legend(False).display_mode(common.LegendDisplayMode.LIST)
                .placement(common.LegendPlacement.BOTTOM)))
    d = d.with_panel(node_series(
        42, "Trainers connected", "Trainer sessions holding a buffer connection.", "short", "zen_connected_trainers"))
    d = d.with_panel(node_series(
        43, "Steps in flight", "Steps opened and not finished.", "short", "zen_steps_in_flight"))
    d = d.with_panel(node_series(
        44, "Buffer pool", "Shared-buffer bytes allocated to trainers.", "bytes", "zen_buffer_pool_bytes"))
    d = d.with_panel(node_series(
        46, "Receive pool", "Capacity of the data plane's reused receive blocks.", "bytes", "zen_receive_pool_bytes",
        width=12))
    d = d.with_panel(node_series(
        47, "Receive block reuse", "Share of pooled payloads that landed in a block used before "
        "(near 1 once steps repeat; low means the pool is too small for the step's messages).", "percentunit",
        "zen_receive_pool_reuse_ratio", width=12))
    d = d.with_panel(
        table.Panel().id(45).title("Daemons").datasource(DS).span(24).height(6)
        .description("What each daemon runs (its zend version, data-plane engine, node, transport, membership), "
                     "its membership "
                     "generation and when that formed (--elastic; 0 with static membership).")
        .with_target(query(f"max by (instance, node, transport, ucx_transports, membership) "
                           f"({sel('zen_node_info')}) * on (instance) group_left (version, engine) "
                           f"max by (instance, version, engine) ({sel('zen_build_info')})", ref="A", instant=True))
        .with_target(query(f"max by (instance) ({sel('zen_membership_generation')})", ref="B", instant=True))
        .with_target(query(f"max by (instance) ({sel('zen_membership_last_change_timestamp_seconds')}) * 1000",
                           ref="C", instant=True))
        .with_transformation(dm.DataTransformerConfig(id_val="merge", options={}))
        .with_transformation(dm.DataTransformerConfig(
            id_val="organize", options={"excludeByName": {"Time": True, "Value #A": True},
                                        "renameByName": {"Value #B": "generation",
                                                         "Value #C": "generation formed"}}))
        .sort_by([cb.TableSortByFieldState().display_name("node")])
        .cell_height(common.TableCellHeight.SM))
    return d


def render() -> str:
    """The dashboard's JSON text, as committed."""
    return JSONEncoder(sort_keys=True, indent=2).encode(build().build()) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--check", action="store_true", help="exit 1 when the committed JSON is not current")
    parser.add_argument("--output", type=Path, default=OUTPUT)
    args = parser.parse_args(argv)
    text = render()
    json.loads(text)  # it must be JSON
    if args.check:
        current = args.output.read_text() if args.output.exists() else ""
        if current != text:
            print(f"{args.output} is stale: run python deploy/grafana/build_dashboard.py", file=sys.stderr)
            return 1
        return 0
    args.output.write_text(text)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
