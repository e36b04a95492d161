"""Launch configurations of the small-group diversity kernels: the measured table and the rule.

A :class:`GroupConfig` says how a program of the group kernel (``pairwise_cosine_groups``) is laid
out: where it sums over D (its variant), groups per program, chunk of D, unroll and warps.
:func:`group_config` takes it from :data:`GROUP_TABLE`, measured per (N, D bucket, dtype size),
else from a deterministic rule on N and D (no autotuning: the same launch compiled or interpreted);
ragged 16-bit groups (counts given) then take the launches that read past holes faster
(:data:`RAGGED_TABLE`, then a rule). Plain integer arithmetic, no Triton: the rule says which
launch a shape would get on a machine that cannot run the kernels too (notebook 06 on a CPU).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

SMALL_N = 64  # groups up to this size take the group kernels (whole groups per program)
# A mean of groups padded to this many rows (N >= 5) takes the closed form, one pass over whole
# rows in registers (the "closed" group kernel), where the Gram matrix costs N^2 D products (in
# float32 two TF32 passes of them; 16 bits: below); float32 rows too long for one step, in
# groups over CLOSED_FORM_LARGE_N, take the large-set closed form (pairwise_cosine_large), which
# splits a group's rows over programs.
CLOSED_FORM_MIN_N = 8
CLOSED_FORM_LARGE_N = 16
# With counts, the closed form's steps stop at the largest count among a program's groups: steps
# of at most this many rows of a group, several groups filling half the tile budget, then skip
# most of the holes. results/diversity-notes.md
CLOSED_FORM_RAGGED_ROWS = 8
# 16-bit means take the closed form in smaller steps: a warp per 256 elements of a row (one
# 16-byte load a lane), up to 4; a step of CLOSED_FORM_16_BIT_WARP_STEP elements a warp (twice
# that for rows from CLOSED_FORM_16_BIT_LONG_D long); whole groups (no counts) fill at least
# CLOSED_FORM_16_BIT_MIN_PROGRAM elements a program; with counts, at most half a group's padded
# rows a step. Groups padded past CLOSED_FORM_16_BIT_WIDE_MAX_N rows of CLOSED_FORM_16_BIT_WIDE_D
# elements or more keep the tensor-core Gram, which reads them faster.
# results/diversity-notes.md
CLOSED_FORM_16_BIT_WARP_STEP = 1024
CLOSED_FORM_16_BIT_LONG_D = 2048
CLOSED_FORM_16_BIT_MIN_PROGRAM = 2048
CLOSED_FORM_16_BIT_WIDE_D = 1024
CLOSED_FORM_16_BIT_WIDE_MAX_N = 16
# The fallback rule keeps the group kernel's (N, N, GROUPS, BLOCK_D) product tile at or under
# this many float32 elements, so it lives in registers: 64 per thread at 4 warps.
GROUP_TILE_ELEMENTS = 8192
GROUP_MAX = 8  # groups per program at most
GROUP_UNROLL = 4  # chunks of D a program loads together, at most
# Where the group kernel sums over D. Production: "vecsum" (group_kernel) sums each chunk's
# products over one thread's 16-byte piece; "pairs" is pairs_kernel (groups of N <= 4, the
# distinct dot products only); "dot" is group_dot_kernel (every group's rows of a program as one
# tile through the tensor cores). Kept for the bench sweep (pairwise_cosine_variants): "tile"
# (every product, summed after the loop) and "gram" (each chunk summed over D across the lanes).
# "closed" (closed_form_kernel) takes the mean only, by its closed form: BLOCK_D is the whole
# row, and a step holds as many rows as fit GROUP_TILE_ELEMENTS.
GroupVariant = Literal["tile", "vecsum", "gram", "pairs", "dot", "closed"]
GROUP_VARIANTS: tuple[str, ...] = ("tile", "vecsum", "gram", "pairs", "dot", "closed")
SWEEP_VARIANTS: tuple[str, ...] = ("tile", "gram")  # run by pairwise_cosine_variants only
PAIRS_MAX_N = 4  # the rows pairs_kernel spells out
PAIRS_PROGRAM_BYTES = 8192  # the "pairs" rule's groups per program read about this much
PAIRS_GROUP_MAX = 16
PAIRS_MAX_WARPS = 4
DOT_ROWS = 64  # rows (groups x BLOCK_N) of the "dot" rule's 16-bit tile, on 4 warps
# 16-bit groups of 5-32 rows: the smallest tile holding whole groups (16 or 32 rows) on one warp,
# in chunks of 64, 128 from rows this long: faster than the 64-row tile on 4 warps (or the same
# tile on 2) at every such point measured but one (results/diversity-notes.md).
# results/diversity-notes.md
DOT_ONE_WARP_MAX_ROWS = 32
DOT_ONE_WARP_LONG_D = 1024
# Rows of at most one 64-element chunk leave a 16-row program too little to do: a 32-row tile
# (two groups of 9-16 rows, four of 5-8) is faster or level at every such point measured, full
# or ragged, on an H100 and an H200; past one chunk it is slower.
# results/diversity-notes.md
DOT_ONE_WARP_SHORT_D = 64
DOT_ONE_WARP_SHORT_ROWS = 32
DOT_ROWS_FP32 = 32  # the float32 tile's rows, on 2 warps (64 rows, past 32-row groups: 4)
# Groups of up to 16 float32 rows: a 16-row tile on one warp, in chunks of 32 elements up to this
# long a row, 64 past: faster than the 32-row tile on two warps (or more warps on either) at
# every such point measured. results/diversity-notes.md
DOT_ROWS_FP32_SMALL = 16
DOT_FP32_SMALL_SHORT_D = 256
# The float32 tile of 64 rows loads each chunk straight into registers (one pipeline stage):
# it splits the chunk into TF32 halves there, and Triton's pipeline would first stage the chunk
# through shared memory, which that tile is bound by. Chunks of 32 elements up to this long a
# row, 64 past. results/diversity-notes.md
DOT_FP32_WIDE_STAGES = 1
DOT_FP32_WIDE_SHORT_D = 768
DOT_MIN_ROWS = 16  # the smallest tile the tensor cores take
DOT_MAX_ROWS = 128  # past this the product's operands outgrow shared memory (float32, H100)
# Ragged 16-bit groups (counts given): the tensor-core tile reads chunks of this many elements,
# which read faster than 128 past the holes that counts leave; and groups of 3-4 rows from this
# long take that tile rather than the pairs kernel. results/diversity-notes.md
RAGGED_BLOCK_D = 64
RAGGED_DOT_MIN_D = 2048


@dataclass(frozen=True)
class GroupConfig:
    """One launch of the group kernel: where it sums over D, and its tile.

    ``num_warps`` should be ``groups * block_d / (32 * elements per 16-byte load)`` (one warp
    per row of 16-byte loads of the (group, feature) plane) so that warps split the groups,
    never the rows or D; other values are correct but exchange values through shared memory,
    which long float32 rows (D past 1024, one group a program) repay: there two warps a row
    read faster than one.
    """

    variant: GroupVariant
    groups: int  # groups per program (a power of 2)
    block_d: int  # features per chunk (a power of 2, >= 16)
    unroll: int  # chunks of D loaded together, at most
    num_warps: int
    num_stages: int | None = None  # software-pipeline stages of the loop over D; Triton's if None
    step_rows: int | None = None  # "closed": rows of each group a step; None: as many as fit

    def __post_init__(self):
        if self.variant not in GROUP_VARIANTS:
            raise ValueError(
                f"variant must be one of {', '.join(GROUP_VARIANTS)}, got {self.variant!r}"
            )
        powers = {"groups": self.groups, "block_d": self.block_d, "num_warps": self.num_warps}
        odd = {k: v for k, v in powers.items() if v < 1 or v & (v - 1)}
        if odd or self.block_d < 16 or self.unroll < 1:
            raise ValueError(
                "groups, block_d and num_warps must be powers of 2, block_d >= 16 and unroll "
                f">= 1; got {self}"
            )
        if self.num_stages is not None and self.num_stages < 1:
            raise ValueError(f"num_stages must be None or >= 1, got {self.num_stages}")
        if self.step_rows is not None and (self.variant != "closed" or self.step_rows < 1):
            raise ValueError(f"step_rows must be None, or >= 1 for 'closed'; got {self}")

    @property
    def name(self) -> str:
        stages = "" if self.num_stages is None else f" S={self.num_stages}"
        step = "" if self.step_rows is None else f" R={self.step_rows}"
        return (
            f"{self.variant} G={self.groups} BD={self.block_d} U={self.unroll} W={self.num_warps}"
            + stages
            + step
        )

    def options(self) -> dict:
        """Triton's launch options: ``num_warps``, and ``num_stages`` where set."""
        stages = {} if self.num_stages is None else {"num_stages": self.num_stages}
        return {"num_warps": self.num_warps} | stages

    def meta(self, d: int, itemsize: int) -> dict:
        """The kernel's launch keywords for rows of ``d`` elements of ``itemsize`` bytes."""
        return (
            dict(
                GROUPS=self.groups,
                BLOCK_D=self.block_d,
                VEC=min(max(1, 16 // itemsize), self.block_d),  # elements per 16-byte load
                UNROLL=max(1, min(self.unroll, cdiv(d, self.block_d))),
            )
            | self.options()
        )


# The fastest configuration measured per (BLOCK_N, D rounded up to a power of 2, bytes per
# element): group_kernel_sweep's rows (accel.lab.cases.diversity; results/*.csv, phase=diversity,
# cases "sweep group kernel ..."), results/diversity-notes.md and
# results/diversity-notes.md. Every other shape takes rule_config's.
GROUP_TABLE: dict[tuple[int, int, int], GroupConfig] = {
    (4, 512, 4): GroupConfig("pairs", groups=1, block_d=128, unroll=1, num_warps=1),
    (4, 512, 2): GroupConfig("pairs", groups=1, block_d=512, unroll=1, num_warps=1),
    (2, 1024, 2): GroupConfig("pairs", groups=1, block_d=256, unroll=1, num_warps=1),
    (2, 2048, 4): GroupConfig("vecsum", groups=1, block_d=128, unroll=4, num_warps=2),
}


# Ragged 16-bit groups (counts given) of up to 4 rows of 129-256 elements: half a warp's row
# of 16-byte loads a chunk, which reads faster past the holes than the full groups' launch
# (a warp a row); results/diversity-notes.md.
RAGGED_TABLE: dict[tuple[int, int, int], GroupConfig] = {
    (2, 256, 2): GroupConfig("pairs", groups=4, block_d=128, unroll=1, num_warps=2),
    (4, 256, 2): GroupConfig("pairs", groups=4, block_d=128, unroll=1, num_warps=2),
}


def rule_config(
    block_n: int, d: int, batch: int, itemsize: int, *, pairs: bool = True
) -> GroupConfig:
    """The fallback: a deterministic rule (no autotuning: the same launch compiled or interpreted).

    Groups of up to 4 rows: "pairs" (only the distinct dot products), about 8 KB of groups per
    program, one warp per row of 16-byte loads of the (group, feature) plane. From 8 rows: the
    tensor-core kernel ("dot"). Float32 takes two TF32 passes per chunk, and the tile is bound
    by what it stages through shared memory, so it stays small: groups of up to 16 rows in a
    16-row tile on one warp (:data:`DOT_ROWS_FP32_SMALL`), of 17-32 in a 32-row tile on 2, of
    33-64 in one 64-row tile on 4 without a pipeline (:data:`DOT_FP32_WIDE_STAGES`). 16-bit:
    groups of 5-32 rows in the smallest tile holding whole groups on one warp
    (:data:`DOT_ONE_WARP_MAX_ROWS`; a 32-row tile for rows of one chunk,
    :data:`DOT_ONE_WARP_SHORT_D`), of 33-64 rows (and 3-4, where "pairs" cannot run) in 64-row
    tiles on 4 warps. ``pairs=False`` (the matrix mode, which "pairs" cannot write) takes
    "dot" from 4 rows in 16 bits, "vecsum" below. results/diversity-notes.md
    and the files named beside the constants have the measurements behind each choice.
    """
    vec = max(1, 16 // itemsize)  # elements per 16-byte load
    if pairs and block_n <= PAIRS_MAX_N:
        block_d = min(max(16, next_power_of_2(d)), 32 * vec)  # one warp's row of loads
        fit = max(1, PAIRS_PROGRAM_BYTES // (block_n * d * itemsize))
        groups = min(1 << (fit.bit_length() - 1), PAIRS_GROUP_MAX, next_power_of_2(batch))
        warps = max(1, min(PAIRS_MAX_WARPS, groups * block_d // (32 * vec)))
        return GroupConfig("pairs", groups=groups, block_d=block_d, unroll=1, num_warps=warps)
    if itemsize == 4 and block_n >= 8:  # float32: the smallest tile, fewest warps, that fit
        if block_n <= DOT_ROWS_FP32_SMALL:
            block_d = 32 if d <= DOT_FP32_SMALL_SHORT_D else 64
            return GroupConfig("dot", DOT_ROWS_FP32_SMALL // block_n, block_d, 1, num_warps=1)
        if block_n <= DOT_ROWS_FP32:
            return GroupConfig("dot", DOT_ROWS_FP32 // block_n, 32, 1, num_warps=2)
        block_d = 32 if d <= DOT_FP32_WIDE_SHORT_D else 64
        return GroupConfig("dot", 1, block_d, 1, num_warps=4, num_stages=DOT_FP32_WIDE_STAGES)
    if itemsize == 2 and 8 <= block_n <= DOT_ONE_WARP_MAX_ROWS:
        rows = DOT_ONE_WARP_SHORT_ROWS if d <= DOT_ONE_WARP_SHORT_D else DOT_MIN_ROWS
        groups = max(1, rows // block_n)
        block_d = 128 if d >= DOT_ONE_WARP_LONG_D else 64
        return GroupConfig("dot", groups, block_d, unroll=1, num_warps=1)
    if itemsize == 2 and block_n >= 4:  # 3-4 rows where "pairs" cannot run, or 33-64
        block_d = 128 if d >= 256 else 64
        return GroupConfig("dot", DOT_ROWS // block_n, block_d, unroll=1, num_warps=4)
    # "vecsum": BLOCK_D is one warp's row of 16-byte loads (128 float32), fewer for short rows;
    # GROUPS fills the tile budget; UNROLL chunks of D are loaded before their products are
    # taken; as many warps as the (GROUPS, BLOCK_D) plane has rows of 16-byte loads, so warps
    # split the groups, never the rows, and no value crosses warps before the epilogue.
    block_d = min(max(16, next_power_of_2(d)), 32 * 4)
    block_d = max(16, min(block_d, GROUP_TILE_ELEMENTS // (block_n * block_n)))
    groups = GROUP_TILE_ELEMENTS // (block_n * block_n * block_d)
    groups = max(1, min(groups, GROUP_MAX, next_power_of_2(batch)))
    warps = groups * block_d // (32 * vec)  # one per row of 16-byte loads of the plane
    return GroupConfig(
        "vecsum",
        groups=groups,
        block_d=block_d,
        unroll=min(GROUP_UNROLL, cdiv(d, block_d)),
        num_warps=max(1, min(8, warps)),
    )


def _whole_rows_fit(d: int) -> bool:
    return next_power_of_2(d) <= GROUP_TILE_ELEMENTS


def group_kernel_takes_mean(n: int, d: int, itemsize: int) -> bool:
    """Whether the group kernels take the mean of groups of ``n`` rows of ``d`` elements (else
    the large-set closed form)."""
    fp32_large = itemsize == 4 and n > CLOSED_FORM_LARGE_N
    return n <= SMALL_N and not (fp32_large and not _whole_rows_fit(d))


def group_config(
    block_n: int, d: int, batch: int, itemsize: int, *, ragged: bool = False
) -> GroupConfig:
    """The configuration the group kernel launches with: the table's, else the rule's; for
    ragged 16-bit groups (``ragged``: counts given), :func:`_ragged_config`'s where it has one."""
    config = GROUP_TABLE.get((block_n, next_power_of_2(d), itemsize))
    if config is None:
        config = rule_config(block_n, d, batch, itemsize)
    if ragged and itemsize == 2:
        return _ragged_config(config, block_n, d)
    return config


def _ragged_config(config: GroupConfig, block_n: int, d: int) -> GroupConfig:
    """A 16-bit launch for groups with holes: :data:`RAGGED_TABLE`'s, else the tensor-core tile
    in chunks of :data:`RAGGED_BLOCK_D`, taken by groups of 3-4 rows from
    :data:`RAGGED_DOT_MIN_D` long."""
    tabled = RAGGED_TABLE.get((block_n, next_power_of_2(d), 2))
    if tabled is not None:
        return tabled
    if config.variant == "pairs" and block_n > 2 and d >= RAGGED_DOT_MIN_D:
        return GroupConfig("dot", DOT_ROWS // block_n, RAGGED_BLOCK_D, unroll=1, num_warps=4)
    if config.variant == "dot":
        return replace(config, block_d=RAGGED_BLOCK_D)
    return config


def mean_config(
    block_n: int, d: int, batch: int, itemsize: int, *, ragged: bool = False
) -> GroupConfig:
    """The configuration of the mean: the closed form's (:func:`closed_form_config`) for groups
    from :data:`CLOSED_FORM_MIN_N` rows whose rows fit a step, but 16-bit groups padded past
    :data:`CLOSED_FORM_16_BIT_WIDE_MAX_N` rows of :data:`CLOSED_FORM_16_BIT_WIDE_D` elements or
    more; else :func:`group_config`."""
    if block_n >= CLOSED_FORM_MIN_N and _whole_rows_fit(d):
        wide = next_power_of_2(d) >= CLOSED_FORM_16_BIT_WIDE_D
        if itemsize == 4 or not (wide and block_n > CLOSED_FORM_16_BIT_WIDE_MAX_N):
            return closed_form_config(block_n, d, batch, itemsize, ragged=ragged)
    return group_config(block_n, d, batch, itemsize, ragged=ragged)


def closed_form_config(
    block_n: int, d: int, batch: int, itemsize: int = 4, *, ragged: bool = False
) -> GroupConfig:
    """The "closed" kernel's launch: whole rows (BLOCK_D the next power of 2 of ``d``).

    Float32: as many groups a step as fit :data:`GROUP_TILE_ELEMENTS` where a whole group does,
    else one group whose rows go as many at a time as fit; one warp per 512 elements, up to 4.
    With counts (``ragged``), steps of at most :data:`CLOSED_FORM_RAGGED_ROWS` rows of each
    group, and as many groups as fill half the budget. 16 bits: the smaller steps of
    :data:`CLOSED_FORM_16_BIT_WARP_STEP`."""
    block_d = max(16, next_power_of_2(d))
    if itemsize == 2:
        return _closed_form_16_bit_config(block_n, block_d, batch, ragged)
    if ragged:
        fits = GROUP_TILE_ELEMENTS // 2 // (_rows_a_step(block_n, 1, block_d, ragged) * block_d)
    else:
        fits = GROUP_TILE_ELEMENTS // (block_n * block_d)
    groups = max(1, min(fits, GROUP_MAX, next_power_of_2(batch)))
    rows = _rows_a_step(block_n, groups, block_d, ragged)
    warps = max(1, min(4, groups * rows * block_d // 512))
    return GroupConfig("closed", groups, block_d, unroll=1, num_warps=warps, step_rows=rows)


def _closed_form_16_bit_config(block_n: int, block_d: int, batch: int, ragged: bool) -> GroupConfig:
    warps = max(1, min(4, block_d // 256))
    step = CLOSED_FORM_16_BIT_WARP_STEP * warps * (2 if block_d >= CLOSED_FORM_16_BIT_LONG_D else 1)
    rows = max(1, min(block_n // 2 if ragged else block_n, step // block_d))
    if rows == block_n:  # whole groups
        step = max(step, CLOSED_FORM_16_BIT_MIN_PROGRAM)
    groups = max(1, min(step // (rows * block_d), GROUP_MAX, next_power_of_2(batch)))
    return GroupConfig("closed", groups, block_d, unroll=1, num_warps=warps, step_rows=rows)


def closed_form_rows(block_n: int, config: GroupConfig, *, ragged: bool = False) -> int:
    """Rows of each group a step of the "closed" kernel holds (BLOCK_N): the configuration's
    ``step_rows``, else as many as fit :data:`GROUP_TILE_ELEMENTS`."""
    if config.step_rows is not None:
        return min(block_n, config.step_rows)
    return _rows_a_step(block_n, config.groups, config.block_d, ragged)


def _rows_a_step(block_n: int, groups: int, block_d: int, ragged: bool) -> int:
    rows = GROUP_TILE_ELEMENTS // (groups * block_d)
    if ragged:
        rows = min(CLOSED_FORM_RAGGED_ROWS, GROUP_TILE_ELEMENTS // block_d)
    return max(1, min(block_n, rows))


def _group_config(block_n: int, d: int, batch: int, itemsize: int) -> dict:
    """Launch keywords of :func:`group_config`: GROUPS, BLOCK_D, VEC, UNROLL, num_warps."""
    return group_config(block_n, d, batch, itemsize).meta(d, itemsize)


def block_rows(n: int) -> int:
    """BLOCK_N of groups of ``n`` rows: the next power of 2, at least 2."""
    return max(2, next_power_of_2(n))


def next_power_of_2(n: int) -> int:
    """``triton.next_power_of_2`` (the smallest power of 2 >= n; 0 for 0), without Triton."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def cdiv(a: int, b: int) -> int:
    """``triton.cdiv``: a / b rounded up."""
    return -(-a // b)
