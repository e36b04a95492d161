"""Checks of the host's side of a step: syncs with the lines that make them, a launch-bound
step (the device waiting for the host), the input pipeline, and communication in a process group.
"""

from __future__ import annotations

import math
import os
from collections import Counter

import torch
from torch.utils._pytree import tree_leaves

from accel.doctor.findings import Evidence, Finding, check
from accel.doctor.recorder import OpRecord, Recording, Site, TensorInfo

DATA_SIZED = "its output's size depends on the data"
LOADER_WAIT_SHARE = 0.05  # a wait for data under this share of the step is no finding
# operators that make the host wait for the device, and what the user wrote to get one
SYNC_OPS = {
    "aten::_local_scalar_dense": "a host read (.item(), float(t), int(t), an `if` on a tensor)",
    "aten::item": "a host read (.item(), float(t), int(t), an `if` on a tensor)",  # inference mode
    "aten::is_nonzero": "an `if` or `bool()` on a tensor",
    "aten::nonzero": f"nonzero(): {DATA_SIZED}",
    "aten::masked_select": f"a boolean mask: {DATA_SIZED}",
    "aten::unique_dim": f"unique(): {DATA_SIZED}",
    "aten::_unique2": f"unique(): {DATA_SIZED}",
    "aten::unique_consecutive": f"unique_consecutive(): {DATA_SIZED}",
    "aten::repeat_interleave": "repeat_interleave with tensor repeats",
    "aten::equal": "torch.equal() returns a Python bool",
}
_COPIES = ("aten::_to_copy", "aten::copy_")
# torch code whose tensors stay on the host on a GPU too (a step counter, a packed sequence's batch
# sizes, a DataLoader's sampler and seeds): its reads are no syncs on a CPU either
_HOST_BY_CONTRACT = ("optim/", "nn/modules/rnn.py:", "utils/data/")
SCALER_READ = "GradScaler.step's read of whether a gradient overflowed"
ARGUMENT_CHECK = "torch.distributions' check of its arguments (validate_args)"
CAUSAL_CHECK = "nn.Transformer's check of whether the mask it was given is causal"
_READ_METHODS = {"__repr__": "print() of a tensor", "__str__": "print() of a tensor",
                 "__format__": "a tensor in an f-string", "tolist": ".tolist()",
                 "numpy": ".numpy()"}  # fmt: skip
PAGEABLE = "a copy from pageable host memory (blocks the host; pin it, non_blocking=True)"
LAUNCH_BOUND_IDLE = 0.3  # share of the step the device idles, waiting for the host or a sync
GRAPH_REPLAY_OVER_KERNELS = 1.1  # a replay's time over its kernels' sum (rows graphs replay_*)
_SYNC_CHANGE = """\
# keep numbers on the device and read them once in a while, not every step:
from accel.sync import MetricAccumulator
metrics = MetricAccumulator(["loss"])        # before the loop
metrics.add(loss=loss.detach())              # in the step: no host read
if step % 100 == 0: print(metrics.read())   # one sync every 100 steps
# an `if` on a tensor -> torch.where(cond, a, b)"""
_DATA_SIZED_CHANGE = """\
# a size the data decides (x[mask], nonzero, torch.where(cond)[0]) is counted on the host:
# keep the shape fixed where the step allows it
x = torch.where(mask, x, 0)                                # not x[mask]
loss = (per_item * mask).sum() / mask.sum().clamp(min=1)   # not per_item[mask].mean()"""
_SCALER_CHANGE = """\
# GradScaler reads whether a gradient overflowed before each optimizer step. Under bf16 autocast
# nothing overflows: drop the scaler. With fp16, a fused optimizer checks on the device:
optimizer = torch.optim.AdamW(model.parameters(), lr=lr, fused=True)  # or Adam, SGD"""
_ARGUMENT_CHECK_CHANGE = """\
# a distribution checks its arguments (and log_prob its sample) on the host: skip the checks
dist = Categorical(logits=logits, validate_args=False)
# or for all of them: torch.distributions.Distribution.set_default_validate_args(False)"""
_CAUSAL_CHECK_CHANGE = """\
# a causal mask given without saying so is compared with one on the host: say it is causal
out = self.transformer(src, tgt, tgt_mask=mask, tgt_is_causal=True)  # nn.Transformer
out = self.encoder(x, mask=mask, is_causal=True)  # nn.TransformerEncoder"""
BACKWARD_COUNT = ("a backward counting rows on the host (a sparse embedding's gradient with "
                  f"padding_idx, for one): {DATA_SIZED}")  # fmt: skip
_BACKWARD_COUNT_CHANGE = """\
# autograd's backward of a library layer counts rows on the host, no line of yours: an
# nn.Embedding(..., sparse=True, padding_idx=p) leaves the padding row out of its gradient so
nn.Embedding(num, dim, padding_idx=p)   # sparse=False: a dense gradient, counted on the device
# (then an optimizer of dense gradients: torch.optim.Adam, not SparseAdam)"""
ANOMALY_CHECK = "anomaly detection's check of each gradient for NaN (set_detect_anomaly)"
_ANOMALY_CHECK_CHANGE = """\
# anomaly detection reads every gradient backward makes on the host: switch it off after debugging
torch.autograd.set_detect_anomaly(False)  # and no `with torch.autograd.detect_anomaly():`"""
# torch's own reads, which no line of the user's writes: each with the change that removes it
_LIBRARY_READS = {
    "amp/grad_scaler.py:": (SCALER_READ, _SCALER_CHANGE),
    "distributions/": (ARGUMENT_CHECK, _ARGUMENT_CHECK_CHANGE),
    "nn/modules/transformer.py:_detect_is_causal_mask": (CAUSAL_CHECK, _CAUSAL_CHECK_CHANGE),
}


def _sync_kind(op: OpRecord, cuda: bool) -> str | None:
    """Why ``op`` makes the host wait for the device (on CUDA), or None. A copy in from pageable
    memory blocks the host too; the input check reports it (with the change that fixes it)."""
    if op.op in SYNC_OPS:
        on_device = any(t.device == "cuda" for t in op.inputs)
        if not (on_device if cuda else not _on_host_by_contract(op.library)):
            return None
        if not cuda and op.api == "one_hot":  # its CPU check of its values: given num_classes,
            return None  # a GPU leaves that to scatter's device assert and reads nothing
        for where, (kind, _) in _LIBRARY_READS.items():
            if any(entry.startswith(where) for entry in op.library):
                return kind
        return SYNC_OPS[op.op]
    if op.op == "aten::index" and any(t.dtype == torch.bool for t in op.inputs[1:]):
        return f"boolean indexing x[mask]: {DATA_SIZED}"
    if cuda and op.op in _COPIES and op.inputs and op.outputs:
        src, dst = _copy_ends(op)
        if src.device == "cuda" and dst.device == "cpu":
            return "a copy to the host (.cpu(), .to('cpu'), .tolist())"
        if src.device == "cpu" and dst.device == "cuda" and not src.pinned:
            return PAGEABLE
    return None


def _on_host_by_contract(library: tuple[str, ...]) -> bool:
    return any(entry.startswith(_HOST_BY_CONTRACT) for entry in library)


def _copy_ends(op: OpRecord) -> tuple[TensorInfo, TensorInfo]:
    """A copy's source and destination."""
    if op.op == "aten::copy_":
        return op.inputs[-1], op.inputs[0]
    return op.inputs[0], op.outputs[0]


def sync_sites(evidence: Evidence) -> Counter:
    """(site, what) -> syncs per step, averaged over the recorded calls: a read made every few
    steps counts the share of the calls it was made in."""
    total: Counter = Counter()
    for recording in evidence.recordings:
        total.update(_sites_of(recording, evidence.cuda))
    return Counter({key: n / len(evidence.recordings) for key, n in total.items()})


def _sites_of(recording: Recording, cuda: bool) -> Counter:
    sites: Counter = Counter()
    previous = None
    for op in recording.ops:
        kind = _sync_kind(op, cuda)
        if kind is not None and op.backward and previous == "aten::_is_any_true":
            kind = ANOMALY_CHECK  # the engine's isnan(grad)._is_any_true().item() per output
        elif kind is not None and op.backward and kind.endswith(DATA_SIZED):
            kind = BACKWARD_COUNT  # a layer's backward: the user wrote no mask
        previous = op.op
        if kind is not None and kind != PAGEABLE:
            sites[(op.site, kind)] += 1
    for read in recording.host_reads:
        if read.device == "cuda" or not (cuda or _on_host_by_contract(read.library)):
            sites[(read.site, _READ_METHODS[read.method])] += 1
    return _merge_same_line(sites)


def _merge_same_line(sites: Counter) -> Counter:
    """One entry per line: an f-string's read and the ``.item()`` inside it are one sync."""
    by_line: dict[Site | None, tuple[str, int]] = {}
    for (site, kind), n in sites.items():
        known = by_line.get(site)
        # a read method names what the user wrote better than the operator inside it
        read = kind in _READ_METHODS.values()
        if known is None or read > (known[0] in _READ_METHODS.values()):
            by_line[site] = (kind, max(n, known[1]) if known else n)
    return Counter({(site, kind): n for site, (kind, n) in by_line.items()})


@check("syncs")
def syncs(evidence: Evidence) -> list[Finding]:
    sites = sync_sites(evidence)
    if not sites:
        return []
    total = sum(sites.values())
    lines = [f"{n:g} x {kind} at {site or 'a line outside your code'}"
             for (site, kind), n in sites.most_common()]  # fmt: skip
    if evidence.more_calls and any(n != round(n) for n in sites.values()):
        lines.append(f"averaged over {len(evidence.recordings)} steps recorded operator by "
                     "operator (not the profiled ones): not every step makes each of them")
    if evidence.cuda:
        t = evidence.timeline
        lines.append(f"the host waited {t.sync_wait_us / 1e3:.3f} ms in them")
        idle, host = t.idle_us.get("sync", 0.0), t.idle_us.get("host", 0.0)
        busy = t.busy_us / (t.busy_us + host) if t.busy_us + host > 0 else 0.0
        each = total * evidence.costs.sync_us
        saved = max(each, idle * busy)
        model = (
            f"the device's idle right after the syncs ({idle / 1e3:.3f} ms), as far as the device "
            f"is not waiting for the host anyway ({busy:.0%} busy otherwise), and at least {total:g} "
            f"x a sync's measured cost ({evidence.costs.sync_us:.1f} us): {saved / 1e3:.3f} ms"
        )
    else:
        saved, model = None, "on a CPU there is no device to wait for: each would sync on a GPU"
    kinds = {kind for _, kind in sites}
    torchs = dict([*_LIBRARY_READS.values(), (ANOMALY_CHECK, _ANOMALY_CHECK_CHANGE),
                   (BACKWARD_COUNT, _BACKWARD_COUNT_CHANGE)])  # fmt: skip
    changes = [change for kind, change in torchs.items() if kind in kinds]
    sized = {kind for kind in kinds - torchs.keys() if kind.endswith(DATA_SIZED)}
    changes += [_SYNC_CHANGE] * bool(kinds - torchs.keys() - sized)
    changes += [_DATA_SIZED_CHANGE] * bool(sized)
    # a read kept for later; the scaler's read made on the device by a fused optimizer; the
    # other syncs (an `if` on a tensor) need your edit
    fixes = ("deferred_reads",) * _reads_items(evidence)
    fixes += ("fused_optimizer",) * (SCALER_READ in kinds)
    title = f"{total:g} host-device sync{'s' * (total != 1)} per step"
    if not evidence.cuda:
        syncs = "a host-device sync" if total == 1 else "host-device syncs"
        title = f"{total:g} host read{'s' * (total != 1)} per step: free on a CPU, {syncs} on a GPU"
        changes.insert(0, "# nothing to gain on a CPU; on a GPU:")
    return [Finding(
        kind="sync",
        title=title,
        evidence="; ".join(lines),
        cost_model=model,
        notebook="01_sync",
        change="\n".join(changes),
        saved_us=saved,
        sites=[s for (s, _), _ in sites.most_common() if s is not None],  # the most made first
        fixes=fixes,
    )]


def _reads_items(evidence: Evidence) -> bool:
    """Whether a sync of the step is a ``.item()`` (the read that :mod:`deferred` defers; a
    ``float(t)`` or an ``if`` makes the same operator, so the line says which)."""
    return any(
        op.op in ("aten::_local_scalar_dense", "aten::item")
        and op.site is not None
        and ".item()" in op.site.text
        for recording in evidence.recordings
        for op in recording.ops
    )


@check("launch_bound")
def launch_bound(evidence: Evidence) -> list[Finding]:
    t = evidence.timeline
    if not evidence.cuda or t.step_us <= 0:
        return []
    waiting = t.idle_us.get("host", 0.0) + t.idle_us.get("sync", 0.0)
    if waiting / t.step_us < LAUNCH_BOUND_IDLE:
        return []
    blockers = capture_blockers(evidence)
    graphed = t.kernel_us * GRAPH_REPLAY_OVER_KERNELS
    idle = ", ".join(f"{k} {v / 1e3:.3f} ms" for k, v in t.idle_us.items())
    return [Finding(
        kind="launch_bound",
        title=f"the device idles {t.idle_fraction:.0%} of the step, waiting for the host",
        evidence=f"{t.launches:.0f} launches and {t.kernels} kernels per step, "
        f"{t.kernel_us / 1e3:.3f} ms of kernels in a {t.step_us / 1e3:.3f} ms step; "
        f"idle by cause: {idle}; "
        + (f"GraphedStep cannot capture it yet: {blockers}" if blockers
           else "nothing seen that would stop GraphedStep from capturing it"),
        cost_model=f"a CUDA graph replays the step's kernels with no host in between: about "
        f"{GRAPH_REPLAY_OVER_KERNELS}x their summed time (the gaps inside a replay)"
        + (", once what stops the capture is gone" if blockers else ""),
        notebook="04_graphs",
        change="from accel.graphs import GraphedStep\n"
        "step = GraphedStep(step)        # capture once, replay every later call\n"
        "# or: model = torch.compile(model, mode='reduce-overhead')",
        # syncs and host batches can be taken out of a step; a changing shape cannot
        saved_us=None if _shape_changes(evidence) else max(0.0, t.step_us - graphed),
        fixes=("cuda_graph", "compile"),
    )]


def capture_blockers(evidence: Evidence) -> str:
    """What would stop a CUDA graph capturing the step, or "" (syncs, host inputs)."""
    why = []
    sites = sync_sites(evidence)
    if sites:
        first = next(iter(sites))
        why.append(f"{sum(sites.values()):g} sync(s), the first at {first[0]} ({first[1]})")
    host = [t for t in tree_leaves(evidence.batch)
            if isinstance(t, torch.Tensor) and t.device.type == "cpu"]  # fmt: skip
    if host:
        why.append(f"{len(host)} batch tensor(s) on the host (copy them in before the step)")
    if _shape_changes(evidence):
        why.append("the batch's shape changes between batches")
    return "; ".join(why)


def _shape_changes(evidence: Evidence) -> bool:
    return evidence.loader is not None and len(evidence.loader["shapes"]) > 1


@check("input_pipeline")
def input_pipeline(evidence: Evidence) -> list[Finding]:
    found = []
    pageable_ops = [op for op in evidence.recording.ops
                    if evidence.cuda and op.op in _COPIES and _sync_kind(op, True) == PAGEABLE]
    if pageable_ops:
        recorded_us = sum(op.time_us for op in pageable_ops)
        nbytes = sum(_copy_ends(op)[0].nbytes for op in pageable_ops)
        # A profiler slows pageable copies: their rate measured outside it bounds what they cost.
        pageable_rate = evidence.copy_in_gb_s(nbytes, pinned=False) if nbytes else math.inf
        copy_us = min(recorded_us, nbytes / (pageable_rate * 1e3))
        rate = evidence.copy_in_gb_s(nbytes, pinned=True) if nbytes else math.inf
        waits_us = evidence.timeline.idle_us.get("host", 0.0)
        saved = pinned_saving_us(copy_us, nbytes, rate, device_waits_us=waits_us)
        found.append(Finding(
            kind="input",
            title=f"{len(pageable_ops)} copies from pageable host memory per step",
            evidence=f"{nbytes / 2**20:.1f} MiB a step copied in from unpinned memory, "
            f"{recorded_us / 1e3:.3f} ms on the device under the profiler (measured here without "
            f"it: {pageable_rate:.1f} GB/s from pageable memory, {rate:.1f} GB/s from pinned)",
            cost_model=f"a pinned, non-blocking copy moves the same bytes every step, at the "
            f"pinned rate measured here: {nbytes / rate / 1e6:.3f} ms instead of "
            f"{copy_us / 1e3:.3f} ms (the pageable copies' time, at most their rate measured "
            f"here), the host no longer waiting for it; the pinned copy runs while the device "
            f"waits for the host ({waits_us / 1e3:.3f} ms a step), and only its time beyond that "
            f"is paid",
            notebook="07_recipe",
            change="x = x.pin_memory().to(device, non_blocking=True)\n"
            "# or DataLoader(..., pin_memory=True) and .to(device, non_blocking=True)",
            saved_us=saved,
            sites=[op.site for op in pageable_ops if op.site is not None],
            fixes=("pinned_batch",),
        ))
    loader = evidence.loader
    if loader is not None and loader["wait_us"] > LOADER_WAIT_SHARE * evidence.step_us:
        found += [f for f in [_loader_finding(evidence, loader)] if f is not None]
    return found


def pinned_saving_us(
    copy_us: float, nbytes: int, pinned_gb_s: float, device_waits_us: float = 0.0
) -> float:
    """What copying ``nbytes`` from pinned memory at ``pinned_gb_s`` saves on pageable copies
    that held the host ``copy_us``: the bytes still move every step, only faster, and without
    the host, so their time hides in the ``device_waits_us`` a step the device idles waiting for
    the host's launches."""
    pinned_us = nbytes / (pinned_gb_s * 1e3)
    return max(0.0, copy_us - max(0.0, pinned_us - device_waits_us))


def _cores() -> int:
    """The cores this process may run on (a container's share, not the host's count)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def proposed_workers(now: int) -> int:
    """The loader workers to propose where the step waits for its data and ``now`` work."""
    return min(_cores(), max(4, 2 * now))  # more workers than cores only take turns


def _loader_finding(evidence: Evidence, loader: dict) -> Finding | None:
    """The wait for data, and more workers as its change: as a copy of the loader with them
    measured (None where that was no faster), else as predicted."""
    settings = f"num_workers={loader['num_workers']}, pin_memory={loader['pin_memory']}"
    wait, step = loader["wait_us"], evidence.step_us
    now = loader["num_workers"] or 0
    workers = proposed_workers(now)
    # each worker makes a batch while the others do: in the wait and the step it overlaps
    made = now * (wait + step) if now else wait
    tried = loader.get("tried")
    if tried is not None and tried["wait_us"] >= wait:
        return None  # handing a batch between processes costs more than making it here
    if workers > now:
        change = (f"DataLoader(dataset, batch_size=..., num_workers={workers}, "
                  + "pin_memory=True, " * evidence.cuda
                  + "\n           persistent_workers=True, prefetch_factor=4)")  # fmt: skip
        if tried is not None:
            cost_model = (f"measured: a copy of the loader with {tried['num_workers']} workers "
                          f"kept the step waiting {tried['wait_us'] / 1e3:.3f} ms per batch")  # fmt: skip
            saved = wait - tried["wait_us"]
        else:
            cost_model = (f"{workers} worker processes make the batches while the step runs, "
                          f"each in the {made / 1e3:.3f} ms one takes now: the wait left is "
                          "their share less the step")  # fmt: skip
            saved = wait - max(0.0, made / workers - step)
    else:  # no core left for another worker: what a batch costs to make is the limit
        cost_model = (f"not predicted: {now} workers on {_cores()} cores, none left to add; what "
                      "a batch costs to make is the limit")  # fmt: skip
        change = ("# make a batch cheaper: decode or augment once ahead of training,\n"
                  "# or keep the data set in memory, not in each __getitem__ call")
        saved = None
    return Finding(
        kind="input",
        title=f"the step waits {wait / 1e3:.2f} ms per batch for its data",
        evidence=f"next(loader) took {wait / 1e3:.3f} ms per batch over {loader['batches']} "
        f"batches against a {step / 1e3:.3f} ms step ({settings})",
        cost_model=cost_model,
        notebook="07_recipe",
        change=change,
        saved_us=saved,
    )


@check("shapes")
def changing_shapes(evidence: Evidence) -> list[Finding]:
    loader = evidence.loader
    if loader is None or len(loader["shapes"]) < 2:
        return []
    return [Finding(
        kind="shapes",
        title=f"the batch's shape changes: {len(loader['shapes'])} shapes in "
        f"{loader['batches']} batches",
        evidence="shapes seen: " + "; ".join(str(s) for s in sorted(loader["shapes"])[:4]),
        cost_model="not predicted: a CUDA graph holds one shape (a new graph per shape), "
        "torch.compile recompiles per shape until it goes dynamic, and the allocator's "
        "cache fragments",
        notebook="04_graphs",
        change=_fewer_shapes(_changing_dims(loader["shapes"]))
        + "# GraphedStep(step, on_new_shape='recapture') keeps one graph per shape",
    )]


def _changing_dims(shapes: set[tuple]) -> list[list[int]]:
    """Per tensor of the batch, the dimensions whose size differs between the batches (1-d
    tensors' marked -1 in place of 0)."""
    seen = sorted(shapes)
    if len({len(s) for s in seen}) != 1:
        return []
    changing = []
    for leaf in zip(*seen, strict=True):  # one tensor of the batch, in every batch
        if len({len(shape) for shape in leaf}) != 1:
            return []
        dims = [d for d, sizes in enumerate(zip(*leaf, strict=True)) if len(set(sizes)) > 1]
        changing.append([-1 if len(leaf[0]) == 1 else d for d in dims])
    return changing


def _fewer_shapes(changing: list[list[int]]) -> str:
    """The change to paste for the dimensions that change: every tensor's first (the batch's
    size), a 1-d length alone (flat indices, which padding would change), or a length to pad."""
    if changing and all(dims in ([0], [-1]) for dims in changing):
        return "# the last batch of an epoch is smaller: DataLoader(..., drop_last=True)\n"
    flat = [dims for dims in changing if dims]
    if flat and all(dims == [-1] for dims in flat):
        return ("# a 1-d tensor's length changes (flat indices, say), which padding would change;\n"
                "# torch.compile(model, dynamic=True) compiles it once\n")  # fmt: skip
    return ("# pad or bucket to a few lengths, e.g. the length (dim 1) to a multiple of 64:\n"
            "x = torch.nn.functional.pad(x, (0, 0) * (x.dim() - 2) + (0, -x.shape[1] % 64))\n")


@check("communication")
def communication(evidence: Evidence) -> list[Finding]:
    t = evidence.timeline
    if t.comm_us <= 0:
        return []
    exposed = t.comm_us - t.comm_overlap_us
    return [Finding(
        kind="communication",
        title=f"communication takes {t.comm_us / t.step_us:.0%} of the step, "
        f"{t.comm_overlap_us / t.comm_us:.0%} of it overlapped with compute",
        evidence=f"{t.comm_us / 1e3:.3f} ms of collective kernels per step, "
        f"{exposed / 1e3:.3f} ms with no compute beside them",
        cost_model="communication fully hidden behind compute saves its exposed time",
        notebook="08_distributed",
        change="DDP(model, bucket_cap_mb=..., gradient_as_bucket_view=True) or FSDP2's "
        "fully_shard(..., reshard_after_forward=False) with prefetching",
        saved_us=exposed,
    )]
