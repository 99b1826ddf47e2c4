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


def eq(label: str, value: str) -> str:
    """`label="value"`, a matcher for `sel`'s extra."""
    return f'{label}="{value}"'


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


def single(pid: int, title: str, description: str, unit: str, target: Dataquery | list[Dataquery],
           steps: list[dm.Threshold], width: int = 3, decimals: float | None = None) -> stat.Panel:
    """A stat panel: one number, or several side by side with their names (`of` a total: see `of_total`)."""
    targets = target if isinstance(target, list) else [target]
    p = (stat.Panel().id(pid).title(title).description(description).datasource(DS).unit(unit).span(width).height(4)
         .reduce_options(cb.ReduceDataOptions().calcs(["lastNotNull"]).values(False))
         .graph_mode(common.BigValueGraphMode.AREA).color_mode(common.BigValueColorMode.VALUE)
         .thresholds(db.ThresholdsConfig().mode(dm.ThresholdsMode.ABSOLUTE).steps(steps)))
    for t in targets:
        p = p.with_target(t)
    if len(targets) > 1:  # "2  of 3": each value under its legend
        p = p.text_mode(common.BigValueTextMode.VALUE_AND_NAME).graph_mode(common.BigValueGraphMode.NONE)
        p = p.override_by_name("of", [dm.DynamicConfigValue(id_val="color",
                                                            value={"mode": "fixed", "fixedColor": "text"})])
    return p.decimals(decimals) if decimals is not None else p


def of_total(name: str, count: str, total: str) -> list[Dataquery]:
    """Two queries a stat panel shows side by side: how many (named `name`), and of how many ("of")."""
    return [query(count, name, "A"), query(total, "of", "B")]


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


# zen_node_state as one number per daemon (the state at 1 times its code), for a state timeline
STATE_CODES = (("joining", 1, "blue"), ("serving", 2, "green"), ("changing", 3, "orange"),
               ("draining", 4, "yellow"), ("stopping", 5, "purple"))
NODE_STATE = "max by (instance) (" + " or ".join(
    f"{sel('zen_node_state', extra=eq('state', name))} * {code}" for name, code, _ in STATE_CODES) + ")"


def timeline(pid: int, title: str, description: str, target: Dataquery, mappings: dict[str, tuple[str, str]],
             width: int = 12) -> statetimeline.Panel:
    """A state timeline, one row per series, each value shown as its mapped word and colour."""
    return (statetimeline.Panel().id(pid).title(title).datasource(DS).span(width).height(8)
            .description(description).with_target(target)
            .mappings([dm.ValueMap(options={value: dm.ValueMappingResult(text=text, color=color, index=i)
                                            for i, (value, (text, color)) in enumerate(mappings.items())})])
            .show_value(common.VisibilityMode.NEVER).merge_values(True).row_height(0.9).fill_opacity(70)
            .line_width(0)
            .legend(cb.VizLegendOptions().show_legend(False).display_mode(common.LegendDisplayMode.LIST)
                    .placement(common.LegendPlacement.BOTTOM)))


def build() -> db.Dashboard:
    d = (db.Dashboard("zen: sparse gradient sync").uid(UID)
         .description("zend daemons: node state and peer links, sync time by phase and the commit, errors by "
                      "cause, bytes on the wire against a dense allreduce, per-job and per-tensor figures, and "
                      "the daemon processes.")
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
                        .query('label_values(zen_job_tensor_steps_total{job=~"$job", instance=~"$instance"}, zen_job)')
                        .refresh(dm.VariableRefresh.ON_TIME_RANGE_CHANGED)
                        .sort(dm.VariableSort.ALPHABETICAL_ASC).multi(True).include_all(True).all_value(".*")))

    # Overview: one number each (two: how many of how many).
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
        4, "Daemons up", "Daemons Prometheus scraped successfully at the last scrape, of the daemons it scrapes "
        "(its targets: a daemon that is down counts in the second number, not the first).", "none",
        of_total("up", f"sum({sel('up')})", f"count({sel('up')})"),
        [dm.Threshold(value=None, color="red"), dm.Threshold(value=1, color="green")]))
    d = d.with_panel(single(
        7, "Nodes serving", "Daemons whose node state is serving (not joining, changing generation, drained or "
        "stopping), of the daemons Prometheus scrapes.", "none",
        of_total("serving", f"sum({sel('zen_node_state', extra=eq('state', 'serving'))})",
                 f"count({sel('up')})"),
        [dm.Threshold(value=None, color="red"), dm.Threshold(value=1, color="green")]))
    d = d.with_panel(single(
        5, "Peers down", "Nodes that at least one daemon has lost its data-plane link to, each counted once "
        "however many daemons lost it (one lost node shows 1; the links, by node, are under Nodes and links).",
        "none", query(f"count(count by (peer) ({sel('zen_peer_up')} == 0)) or vector(0)"), green_then((1, "red"))))
    d = d.with_panel(single(
        6, "Faults / s", "Failed requests and steps per second that are a daemon's, a peer's or the network's "
        "fault (cause=\"fault\": UNAVAILABLE, ABORTED, DEADLINE_EXCEEDED, INTERNAL, ...).", "ops",
        query(f"sum(rate({sel('zen_errors_total', extra=eq('cause', 'fault'))}[{RATE}]))"
              " or vector(0)"), green_then((0.001, "red")), decimals=3))
    d = d.with_panel(single(
        8, "Client errors / s", "Requests per second refused for the caller's mistake (cause=\"client\": "
        "INVALID_ARGUMENT, NOT_FOUND, PERMISSION_DENIED, RESOURCE_EXHAUSTED, ...); they never page.", "ops",
        query(f"sum(rate({sel('zen_errors_total', extra=eq('cause', 'client'))}[{RATE}]))"
              " or vector(0)"), green_then((0.001, "orange")), decimals=3))

    d = d.with_row(db.Row("Nodes and links").id(105))
    d = d.with_panel(timeline(
        48, "Node state", "Each daemon's state: joining its cluster, serving, changing generation (--elastic), "
        "drained by an operator (zend status --drain) or stopping.",
        query(NODE_STATE, "{{instance}}"),
        {str(code): (name, color) for name, code, color in STATE_CODES}))
    d = d.with_panel(timeline(
        41, "Peer links", "Each daemon's data-plane link to each peer node.",
        query(f"max by (instance, peer) ({sel('zen_peer_up')})", "{{instance}} → node {{peer}}"),
        {"0": ("down", "red"), "1": ("up", "green")}))
    d = d.with_panel(series(
        49, "Links down, by node", "For each node, how many daemons have lost their link to it: one lost node "
        "is one line at the number of its peers, not a line per daemon.", "short",
        [query(f"sum by (peer) (1 - {sel('zen_peer_up')})", "node {{peer}}", "A"),
         query(f"count by (peer) ({sel('zen_peer_up')})", "node {{peer}}: daemons reporting", "B")]))
    d = d.with_panel(series(
        9, "Membership generation", "Each daemon's membership generation: a step up is a new generation (nodes "
        "joined or left, --elastic); daemons of one cluster agree.", "short",
        [query(f"max by (instance) ({sel('zen_membership_generation')})", "{{instance}}")]))

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

    commit = eq("phase", "commit")
    d = d.with_row(db.Row("Commit and errors").id(106))
    d = d.with_panel(series(
        50, "Commit time, by daemon (p50, p99)", "The commit: two all-to-all rounds of one byte after the scheme, "
        "so that every node delivers a step or none does; its time is the nodes' round trips (and a slow peer's "
        "lag).", "s",
        [query(f"histogram_quantile(0.5, sum by (instance, le) "
               f"(rate({sel('zen_sync_duration_seconds_bucket', extra=commit)}[{RATE}])))", "p50 {{instance}}", "A"),
         query(f"histogram_quantile(0.99, sum by (instance, le) "
               f"(rate({sel('zen_sync_duration_seconds_bucket', extra=commit)}[{RATE}])))", "p99 {{instance}}",
               "B")], width=8))
    d = d.with_panel(series(
        51, "Commit share of the step", "The commit's share of a step's time on each node (all phases).",
        "percentunit",
        [query(f"sum by (instance) (rate({sel('zen_sync_duration_seconds_sum', extra=commit)}[{RATE}]))"
               f" / sum by (instance) (rate({sel('zen_sync_duration_seconds_sum')}[{RATE}]))", "{{instance}}")],
        width=8))
    d = d.with_panel(series(
        40, "Errors by cause and code", "Failed requests and steps per second, by cause (fault: a daemon's, a "
        "peer's or the network's, which alerts; client: the caller's mistake, which does not) and gRPC status "
        "code. Aborted steps are ABORTED (a node lost or standing still during a step, a generation change).",
        "ops", [query(f"sum by (cause, code) (rate({sel('zen_errors_total')}[{RATE}]))", "{{cause}}: {{code}}")],
        width=8))

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

    d = d.with_row(db.Row("Per job").id(107))
    job_step = sel("zen_job_step_duration_seconds_bucket", TENSOR)
    d = d.with_panel(series(
        60, "Step time by job (p50, p99)", "A trainer's step in its daemon, end to end, by training job.", "s",
        [query(f"histogram_quantile(0.5, sum by (zen_job, le) (rate({job_step}[{RATE}])))", "p50 {{zen_job}}", "A"),
         query(f"histogram_quantile(0.99, sum by (zen_job, le) (rate({job_step}[{RATE}])))", "p99 {{zen_job}}",
               "B")], width=8))
    d = d.with_panel(series(
        61, "Bytes sent by job", "Data-plane payload bytes per second sent for each job's steps, all daemons.",
        "Bps", [query(f"sum by (zen_job) (rate({sel('zen_job_sent_bytes_total', TENSOR)}[{RATE}]))",
                      "{{zen_job}}")], width=8))
    d = d.with_panel(series(
        62, "Tensor-steps / s by job", "Tensor-steps synchronised per second for each job, all daemons.", "ops",
        [query(f"sum by (zen_job) (rate({sel('zen_job_tensor_steps_total', TENSOR)}[{RATE}]))", "{{zen_job}}")],
        width=8))

    d = d.with_row(db.Row("Checkpoints in memory").id(108))
    d = d.with_panel(node_series(
        80, "Checkpoint bytes held", "In-memory checkpoint bytes each daemon holds: its trainers' objects and its "
        "peers' replicas (bounded by --checkpoint-memory-bytes).", "bytes", "zen_checkpoint_bytes", width=6))
    d = d.with_panel(series(
        81, "Newest complete checkpoint step", "The newest checkpoint step complete on each node, by job: nodes that "
        "disagree for long are replicating slowly.", "none",
        [query(f"max by (zen_job, instance) ({sel('zen_checkpoint_last_complete_step', TENSOR)})",
               "{{zen_job}} {{instance}}")], width=6))
    ckpt = sel("zen_checkpoint_replication_seconds_bucket")
    d = d.with_panel(series(
        82, "Replication lag (p50, p99)", "From a checkpoint step whole on a node to complete on every node "
        "(offers, replicas to the holders, acknowledgement).", "s",
        [query(f"histogram_quantile(0.5, sum by (le) (rate({ckpt}[{RATE}])))", "p50", "A"),
         query(f"histogram_quantile(0.99, sum by (le) (rate({ckpt}[{RATE}])))", "p99", "B")], width=6))
    d = d.with_panel(series(
        83, "Recovery and restore", "Seconds to recover a lost node's checkpoint from a peer (census) and to "
        "serve trainers' reads, p99; checkpoint failures per second.", "s",
        [query(f"histogram_quantile(0.99, sum by (le) (rate({sel('zen_checkpoint_recovery_seconds_bucket')}"
               f"[{RATE}])))", "recovery p99", "A"),
         query(f"histogram_quantile(0.99, sum by (le) (rate({sel('zen_checkpoint_restore_seconds_bucket')}"
               f"[{RATE}])))", "restore p99", "B"),
         query(f"sum(rate({sel('zen_checkpoint_failures_total')}[{RATE}]))", "failures / s", "C")], width=6))
    d = d.with_panel(series(
        84, "Checkpoint bytes read and recovered", "Bytes per second trainers read from their daemon's checkpoints "
        "(a restore) and daemons recovered from peers' copies (a census after a node lost its memory).", "Bps",
        [query(f"sum(rate({sel('zen_checkpoint_restored_bytes_total')}[{RATE}]))", "read by trainers", "A"),
         query(f"sum(rate({sel('zen_checkpoint_recovered_bytes_total')}[{RATE}]))", "recovered from peers", "B")],
        width=24))

    d = d.with_row(db.Row("Per tensor").id(103))
    d = d.with_panel(tensor_series(
        30, "Push imbalance", "Cluster push load imbalance at each tensor's last step (max / mean; 1 = even).",
        "x", "zen_push_imbalance_ratio"))
    d = d.with_panel(tensor_series(
        31, "Pull imbalance", "Cluster pull imbalance at each tensor's last step (max / mean; 1 = even).",
        "x", "zen_pull_imbalance_ratio"))
    d = d.with_panel(tensor_series(
        32, "Densification", "Non-zero rows of the sum / mean non-zero rows contributed per node.", "x",
        "zen_tensor_densification_ratio"))
    d = d.with_panel(tensor_series(
        33, "Density", "Non-zero rows of the summed gradient / rows.", "percentunit", "zen_tensor_density_ratio"))
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

    d = d.with_row(db.Row("Daemons").id(104))
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
    d = d.with_panel(series(
        70, "File descriptors, of the limit", "Open descriptors / the process' limit, by daemon: every trainer, "
        "buffer, peer link and connection takes one; at the limit nothing new is accepted (alert at 80%).",
        "percentunit", [query(f"{sel('process_open_fds')} / {sel('process_max_fds')}", "{{instance}}")], width=6))
    d = d.with_panel(series(
        71, "Memory", "Resident and virtual memory of each daemon process (shared buffers count where touched).",
        "bytes", [query(sel("process_resident_memory_bytes"), "resident {{instance}}", "A"),
                  query(sel("process_virtual_memory_bytes"), "virtual {{instance}}", "B")], width=6))
    d = d.with_panel(series(
        72, "CPU", "CPU time each daemon process spends per second (cores).", "short",
        [query(f"rate({sel('process_cpu_seconds_total')}[{RATE}])", "{{instance}}")], width=6))
    d = d.with_panel(series(
        73, "Python garbage collection", "Collections per second by generation (a full collection stalls the "
        "daemon's threads), and objects found uncollectable.", "short",
        [query(f"sum by (generation) (rate({sel('python_gc_collections_total')}[{RATE}]))",
               "collections gen {{generation}}", "A"),
         query(f"sum by (generation) (rate({sel('python_gc_objects_collected_total')}[{RATE}]))",
               "objects collected gen {{generation}}", "B"),
         query(f"sum by (generation) ({sel('python_gc_objects_uncollectable_total')})",
               "uncollectable gen {{generation}}", "C")], width=6))
    d = d.with_panel(
        table.Panel().id(45).title("Daemons").datasource(DS).span(24).height(6)
        .description("What each daemon runs (its zend version, data-plane engine, node, transport, membership, "
                     "Python), its state, its membership generation and when that formed (--elastic; 0 with "
                     "static membership), and when the process started.")
        .with_target(query(f"max by (instance, node, transport, ucx_transports, membership) "
                           f"({sel('zen_node_info')}) * on (instance) group_left (version, engine) "
                           f"max by (instance, version, engine) ({sel('zen_build_info')})", ref="A", instant=True))
        .with_target(query(f"max by (instance) ({sel('zen_membership_generation')})", ref="B", instant=True))
        .with_target(query(f"max by (instance) ({sel('zen_membership_last_change_timestamp_seconds')}) * 1000",
                           ref="C", instant=True))
        .with_target(query(f"max by (instance, state) ({sel('zen_node_state')} == 1)", ref="D", instant=True))
        .with_target(query(f"max by (instance, python) (label_replace({sel('python_info')}, "
                           f"\"python\", \"$1\", \"version\", \"(.*)\"))", ref="E", instant=True))
        .with_target(query(f"max by (instance) ({sel('process_start_time_seconds')}) * 1000", ref="F",
                           instant=True))
        .with_transformation(dm.DataTransformerConfig(id_val="merge", options={}))
        .with_transformation(dm.DataTransformerConfig(
            id_val="organize", options={"excludeByName": {"Time": True, "Value #A": True, "Value #D": True,
                                                          "Value #E": True},
                                        "renameByName": {"Value #B": "generation",
                                                         "Value #C": "generation formed",
                                                         "Value #F": "started"}}))
        .align(common.FieldTextAlignment.AUTO).inspect(False)  # field config as Grafana's table model writes it
        .override_by_name("started", [dm.DynamicConfigValue(id_val="unit", value="dateTimeFromNow")])
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
