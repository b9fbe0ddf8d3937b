"""The fused planning kernels (predictor/plan_triton.py) against the torch path of SpinIndexer.plan(), under
TRITON_INTERPRET=1 on the CPU or on CUDA: several steps over random but valid states (fp16 vertical history
with never-scored blocks, block maxima consistent with it, diagonal windows with holes, new and old
requests), every config the kernel supports on one axis at a time, odd shapes (keep_all, guarded, one
block, partial last block, W not a power of two, next_n 1/2/4, empty batch) and out-of-range block ids.
Both selection paths run: the register tile (one [next_pow2(W)] tile per request, bisection by counting)
and the chunked scratch path (forced with register_tile=0, tiles of 16 blocks). The register path's
threshold helpers are also checked alone against a sort. Workspace outputs are poisoned before the kernel;
kept entries are compared below num_kept only."""
import dataclasses

import pytest
import torch

from spin_indexer.indexer import SpinIndexer
from spin_indexer.predictor import SpinConfig

pytestmark = pytest.mark.interpreter
T = 64
NEG = float("-inf")
# slot grain: the tests read and write V (block grain is the default for this rule)
BASE = SpinConfig(vertical_grain="slot", sparsity=0.45, topk=128, gamma=0.2, diagonal_window=200, dense_below=640,
                  seed=7)
STATE = ("vertical", "block_max", "diagonal", "step", "seen_len", "clock")


def _values(shape, gen, grid):
    """fp16 values with about 20% -inf holes: on a 1/8 grid ("fine": sums exact in float32, so reduce=mean
    compares bit for bit), small integers ("coarse": many tied block scores), one value ("flat": every
    scored block ties) or normal ones (None)."""
    if grid == "flat":
        return torch.full(shape, 0.5).half()
    if grid == "coarse":
        x = torch.randint(-3, 4, shape, generator=gen).float()
    elif grid:
        x = torch.randint(-64, 65, shape, generator=gen).float() / 8
    else:
        x = torch.randn(shape, generator=gen) * 4
    return torch.where(torch.rand(shape, generator=gen) < 0.2, NEG, x).half()


def _randomize(state, gen, grid, touched=None):
    """A random valid history: vertical with never-scored blocks, block_max = its max over the block,
    diagonal windows with holes, random step counters. The trash block stays -inf. touched: physical
    blocks to rewrite (an EMA update between steps), None = all."""
    blocks = state.num_cache_blocks
    ids = torch.arange(blocks) if touched is None else touched
    v = _values((state.num_layers, len(ids), T), gen, grid)
    never = torch.rand(state.num_layers, len(ids), 1, generator=gen) < 0.15
    v = torch.where(never, NEG, v.float()).half()
    state.vertical[:, ids] = v
    state.block_max[ids] = v.amax(dim=2).t()
    state.vertical[:, blocks] = NEG
    state.block_max[blocks] = NEG
    state.diagonal.copy_(_values(tuple(state.diagonal.shape), gen, grid))
    if touched is None:
        state.step.copy_(torch.randint(0, 1000, state.step.shape, generator=gen).int())


def _copy_state(dst, src):
    for name in STATE:
        getattr(dst, name).copy_(getattr(src, name))


def _poison(ws):
    for name in ("kept_blocks", "compact_table", "num_kept", "compact_lens", "num_blocks"):
        getattr(ws, name).fill_(-7)
    ws.guarded.view(torch.uint8).fill_(7)
    ws.update_rows.view(torch.uint8).fill_(7)


def _table(final_lens, width, num_cache_blocks, gen, bad=False):
    """int32 [B, W]: distinct physical ids per request for its final length; bad: some used ids outside."""
    perm = torch.randperm(num_cache_blocks, generator=gen)
    table = torch.full((len(final_lens), width), -1, dtype=torch.int32)
    at = 0
    for b, length in enumerate(final_lens):
        used = min(-(-length // T), width)
        table[b, :used] = perm[at:at + used].int()
        at += used
        if bad and used:
            cols = torch.randint(0, used, (2,), generator=gen)
            table[b, cols[0]] = num_cache_blocks + int(torch.randint(0, 3, (1,), generator=gen))
            table[b, cols[1]] = [-3, 2**31 - 1, -(2**31)][b % 3]
    return table


def _step_table(table, lens):
    """The table of one step: columns past each request's used blocks hold garbage."""
    out = table.clone()
    junk = torch.tensor([-1, 2**31 - 1, -(2**31), 10**6], dtype=torch.int32)
    for b, length in enumerate(lens):
        used = min(-(-length // T), out.shape[1])
        out[b, used:] = junk[torch.arange(out.shape[1] - used) % 4]
    return out


def _rows(lens, next_n):
    j = torch.arange(next_n)
    return (torch.tensor(lens, dtype=torch.int64)[:, None] - next_n + j + 1).clamp_min(0).int().reshape(-1, next_n)


class _Host:
    """CPU copies of an indexer's workspace and state (the kernel may run on CUDA)."""

    def __init__(self, idx):
        self.workspace = type("W", (), {k: v.cpu() for k, v in vars(idx.workspace).items() if v is not None})
        self.state = type("S", (), {k: getattr(idx.state, k).cpu() for k in STATE})


def _check(ref, got, batch, width, layers):
    got = _Host(got)
    wr, wg = ref.workspace, got.workspace
    assert torch.equal(wg.num_blocks[:batch], wr.num_blocks[:batch])
    assert torch.equal(wg.guarded[:batch].view(torch.uint8), wr.guarded[:batch].to(torch.uint8))
    assert torch.equal(wg.update_rows[:batch].view(torch.uint8), wr.update_rows[:batch].to(torch.uint8))
    for layer in range(layers):
        nk = wr.num_kept[layer, :batch]
        assert torch.equal(wg.num_kept[layer, :batch], nk), f"layer {layer}: num_kept"
        live = torch.arange(width)[None, :] < nk[:, None].long()
        for name in ("kept_blocks", "compact_table"):
            a, e = getattr(wg, name)[layer, :batch, :width], getattr(wr, name)[layer, :batch, :width]
            assert torch.equal(torch.where(live, a, 0), torch.where(live, e, 0)), f"layer {layer}: {name}"
        assert torch.equal(wg.compact_lens[layer, :batch], wr.compact_lens[layer, :batch]), f"layer {layer}: lens"
    for name in STATE:
        assert torch.equal(getattr(got.state, name), getattr(ref.state, name)), f"state.{name}"


def _run(cfg, final_lens, next_n, gen, dev, steps=2, layers=2, grow=None, accepted=False, bad=False, seen=None,
         grid=None, graph=False, path="register", extra_width=2, shared=0, view_pad=0):
    """Plan `steps` steps with the torch path and the kernel from the same random state and compare everything
    each step. path: the kernel's selection path ("register" or "chunked"); extra_width: table columns past
    the longest request (< 0: lengths past the table, as plan(validate=False) may get); shared: the first
    `shared` blocks of every request are request 0's (a prefix-cache hit); view_pad: the table is a view of a
    view_pad columns wider one whose extra columns hold ids of used blocks (a read past a row finds them)."""
    from spin_indexer.predictor.plan_triton import plan_step_triton, supports
    assert supports(cfg)
    batch = len(final_lens)
    grow = [0] * (steps - 1) + [0] if grow is None else grow
    width = max([-(-x // T) for x in final_lens], default=1) + extra_width
    slots = batch + 3
    cache = sum(-(-x // T) for x in final_lens) + 4
    kw = dict(num_layers=layers, max_batch=max(batch, 1), max_blocks=width, next_n=next_n, max_requests=slots,
              num_cache_blocks=cache)
    ref, got = SpinIndexer(cfg, **kw), SpinIndexer(cfg, device=dev, **kw)
    # the torch plan always runs here, also where the table's shape alone guards the step (plan() then skips
    # its kernels: SpinIndexer._dense_plan): the device-side guard is what the kernel must reproduce
    ref._guarded_by_shape = lambda batch, width: False
    for _ in range(slots):
        ref.state.allocate(), got.state.allocate()
    grid = grid or ("fine" if cfg.reduce.value == "mean" else None)
    _randomize(ref.state, gen, grid)
    slot_ids = torch.randperm(slots, generator=gen)[:batch]
    table = _table(final_lens, width, cache, gen, bad=bad)
    table[1:, :shared] = table[:1, :shared]
    lens = [max(0, x - sum(grow)) for x in final_lens]
    # seen_len: every third request is new (0), the others saw between half and all of their context
    start = seen if seen is not None else [int(torch.randint(x // 2, x + 1, (1,), generator=gen)) if b % 3 != 2 else 0
                                          for b, x in enumerate(lens)]
    for b in range(batch):
        ref.state.seen_len[slot_ids[b]] = min(start[b], lens[b])
    _copy_state(got.state, ref.state)
    for s in range(steps):
        seq_lens = _rows(lens, next_n)
        step_table = _step_table(table, lens)
        if view_pad:
            wide = torch.cat([step_table, table.flip(0)[:, :view_pad].clamp(0, cache - 1)], dim=1)
            step_table = wide[:, :width]
        acc = torch.randint(0, next_n, (batch,), generator=gen).int() if accepted else None
        ref.plan(step_table, seq_lens, slot_ids, num_accepted=acc, validate=not bad and extra_width >= 0)
        _poison(got.workspace)
        args = [x.to(dev) if x is not None else None for x in (step_table, seq_lens, slot_ids.long(), acc)]
        if graph:  # capture the step in a CUDA graph (no host sync, fixed shapes), replay it once
            saved = {k: getattr(got.state, k).clone() for k in STATE}
            plan_step_triton(cfg, got.state, got.workspace, *args)  # compile outside the capture
            for k, v in saved.items():
                getattr(got.state, k).copy_(v)
            _poison(got.workspace)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                plan_step_triton(cfg, got.state, got.workspace, *args)
            g.replay()
        else:
            plan_step_triton(cfg, got.state, got.workspace, *args, block=16, score_block=8,
                             register_tile=0 if path == "chunked" else 1 << 14)
        _check(ref, got, batch, width, layers)
        # an EMA update between steps, the same on both sides
        touched = torch.randperm(cache, generator=gen)[:2 * cache // 3]
        _randomize(ref.state, gen, grid, touched)
        for name in ("vertical", "block_max", "diagonal"):
            getattr(got.state, name).copy_(getattr(ref.state, name))
        lens = [x + grow[s] if x else 0 for x in lens]


@pytest.mark.parametrize("seen", [[0, 30 * T], [30 * T, 0]], ids=["first-enters", "second-enters"])
def test_shared_prefix_blocks_reset_when_one_sharer_enters(seen, gen, triton_device):
    """Two requests share their first 8 blocks (a prefix-cache hit); one of them is new: the shared blocks
    entered it, so both paths reset them for everybody, whichever row comes first (the torch path once
    kept the row order's last write)."""
    _run(BASE, [30 * T + 7, 20 * T + 1], 1, gen, triton_device, seen=seen, shared=8)


@pytest.fixture(params=["register", "chunked"])
def plan_path(request) -> str:
    """The select kernel's path: one register tile per request, or the chunked scratch fallback."""
    return request.param


# lengths: long (W not a power of two, partial last block), guarded (< 640), keep_all (<= 128), one block,
# an empty padding request
LENS = (37 * T + 5, 400, 100, 64, 0)


@pytest.mark.parametrize("cfg", [
    BASE,
    dataclasses.replace(BASE, exploration="none", gamma=0.0),
    dataclasses.replace(BASE, combine="sum"),
    dataclasses.replace(BASE, combine="vertical", sparsity=0.7),
    dataclasses.replace(BASE, combine="diagonal", sparsity=0.3),
    dataclasses.replace(BASE, reduce="mean"),
    dataclasses.replace(BASE, reduce="mean", combine="sum", exploration="none", gamma=0.0),
    dataclasses.replace(BASE, reduce="mean", combine="diagonal", diagonal_window=None),
    dataclasses.replace(BASE, sparsity_profile=(0.4, 1.6)),  # layer 0 at 0.18, layer 1 at 0.72
    dataclasses.replace(BASE, reduce="mean", sparsity_profile=(1.5, 0.5)),
    # the long request (2303 tokens, then 2373: the others are guarded) crosses profile_from between the two steps
    dataclasses.replace(BASE, sparsity_profile=(0.4, 1.6), profile_from=37 * T - 30),
    # and below it takes the profile at 0.3 of its spread (layer 0 at 0.369, layer 1 at 0.531)
    dataclasses.replace(BASE, sparsity_profile=(0.4, 1.6), profile_from=37 * T - 30, short_profile_strength=0.3),
], ids=["max-max-random", "none", "sum", "vertical", "diagonal", "mean", "mean-sum-none", "mean-diag-full", "profile",
        "mean-profile", "profile-from", "profile-from-short"])
def test_row0_matches_torch(cfg, gen, triton_device, plan_path):
    _run(cfg, LENS, 1, gen, triton_device, grow=[70, 0], path=plan_path)


@pytest.mark.parametrize("next_n,mtp,accepted,reduce,combine,window", [
    (2, "row-local", True, "max", "max", 200), (4, "row-local", False, "mean", "diagonal", None),
    (4, "row-local", True, "mean", "diagonal", 300), (2, "row0", False, "max", "max", 200),
    (4, "row0", True, "mean", "sum", 200)])
def test_next_n_matches_torch(next_n, mtp, accepted, reduce, combine, window, gen, triton_device, plan_path):
    # row-local + mean over the whole diagonal: every row ranks the blocks differently, so the union matters
    cfg = dataclasses.replace(BASE, mtp=mtp, reduce=reduce, combine=combine, diagonal_window=window)
    _run(cfg, LENS[:4] + (3,), next_n, gen, triton_device, grow=[next_n, 0], accepted=accepted, path=plan_path)


def test_short_contexts_and_empty_batch(gen, triton_device, plan_path):
    # contexts all <= K (keep_all) or one block, a guard off; then B = 0 (only the clock advances)
    cfg = dataclasses.replace(BASE, dense_below=0, topk=64)
    _run(cfg, (64, 1, 63, 65, 130), 2, gen, triton_device, steps=2, grow=[1, 0], path=plan_path)
    _run(cfg, (), 1, gen, triton_device, steps=2, path=plan_path)


def test_ties_and_sparsity_edges(gen, triton_device, plan_path):
    # grid values (many tied block scores), sparsity where floor(s * n) sits on an integer
    for s, reduce in ((0.3, "max"), (0.5, "mean"), (0.95, "max"), (0.0, "mean")):
        cfg = dataclasses.replace(BASE, sparsity=s, reduce=reduce, dense_below=0)
        _run(cfg, (50 * T, 10 * T + 1, 12 * T), 1, gen, triton_device, grow=[T, 0], layers=1, grid="coarse",
             path=plan_path)


def test_out_of_range_block_ids(gen, triton_device, plan_path):
    # used blocks with ids outside the cache (plan(validate=False)): read as the all--inf trash block,
    # never read or written outside the state's tensors; same plan as the torch path
    _run(BASE, LENS[:4], 2, gen, triton_device, steps=2, grow=[1, 0], bad=True,
         seen=[10 * T, 0, 0, 0], path=plan_path)
    _run(dataclasses.replace(BASE, reduce="mean", combine="sum"), LENS[:2], 1, gen, triton_device, steps=1,
         bad=True, seen=[0, 100], path=plan_path)


@pytest.mark.parametrize("cfg", [BASE, dataclasses.replace(BASE, mtp="row-local", reduce="mean")],
                         ids=["base", "row-local-mean"])
def test_lengths_past_the_table_read_as_the_table(cfg, gen, triton_device, plan_path):
    # plan(validate=False) with rows longer than W x T (request 0 by 3 blocks, request 2 by a few tokens): both
    # paths span min(ceil(len / T), W) blocks, and the kernel reads no id past a row (the wider table behind
    # the view holds used ids there: a read past the row would keep, score or reset them)
    _run(cfg, (40 * T + 5, 20 * T, 37 * T + 7, 5 * T), 2, gen, triton_device, steps=2, grow=[T, 0],
         extra_width=-3, view_pad=4, path=plan_path)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_step_captures_in_a_cuda_graph(gen):
    cfg = dataclasses.replace(BASE, mtp="row-local")
    _run(cfg, LENS[:4] + (300 * T,), 2, gen, "cuda", grow=[2, 0], graph=True)


@pytest.mark.parametrize("lens,extra_width", [
    ((32 * T, 20 * T + 3), 0),  # W = 32 = the tile: every lane holds a block of the longest request
    ((32 * T, 33 * T - 5, 31 * T + 1), 0),  # n = 32, 33 (just above: tile 64) and 31 in one batch
], ids=["w-pow2", "w-pow2-plus-1"])
def test_power_of_two_widths(lens, extra_width, gen, triton_device, plan_path):
    cfg = dataclasses.replace(BASE, mtp="row-local")
    _run(cfg, lens, 2, gen, triton_device, steps=1, grow=[0], path=plan_path, extra_width=extra_width)


@pytest.mark.parametrize("cfg,grid", [
    # every scored block ties (one value everywhere): stage B keeps the lowest blocks among equals
    (dataclasses.replace(BASE, dense_below=0, reduce="mean"), "flat"),
    (dataclasses.replace(BASE, dense_below=0, combine="vertical"), "flat"),
    # random exploration with gamma = 0: stage C has need = 0
    (dataclasses.replace(BASE, dense_below=0, gamma=0.0), None),
    # gamma near 1: k1 = the forced blocks, stage B takes no unforced block (need = count of +inf keys)
    (dataclasses.replace(BASE, dense_below=0, gamma=0.99), None),
    # sparsity 0 without exploration: need = count (every candidate taken)
    (dataclasses.replace(BASE, dense_below=0, sparsity=0.0, exploration="none", gamma=0.0), None),
    # diagonal only, small window: blocks before it score -inf (not candidates) beside the forced +inf ones
    (dataclasses.replace(BASE, dense_below=0, combine="diagonal", diagonal_window=70, sparsity=0.2), "coarse"),
], ids=["flat-mean", "flat-vertical", "explore-need-0", "stage1-forced-only", "need-eq-count", "inf-mix"])
def test_selection_edges(cfg, grid, gen, triton_device, plan_path):
    _run(cfg, (24 * T + 7, 9 * T, 40 * T), 1, gen, triton_device, steps=2, grow=[T, 0], layers=1, grid=grid,
         path=plan_path)


try:
    import triton
    import triton.language as tl

    from spin_indexer.predictor.select_triton import _take, _threshold

    @triton.jit
    def _threshold_probe(key_ptr, ok_ptr, need_ptr, out_ptr, S: tl.constexpr, UNIFORM: tl.constexpr):
        """out int8 [S]: the lanes _threshold + _take select for keys uint32 (given as int64, >= 1 where ok)
        and ok int8; the kernel marks the non-candidates with key 0."""
        i = tl.arange(0, S)
        key = tl.where(tl.load(ok_ptr + i) != 0, tl.load(key_ptr + i).to(tl.uint32), 0)
        t, ties = _threshold(key, tl.load(need_ptr), UNIFORM)
        tl.store(out_ptr + i, _take(key, t, ties).to(tl.int8))
except ImportError:  # pragma: no cover
    triton = None


def _ukey_ref(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> order-preserving uint32 as int64 (the kernel's _ukey, -0.0 folded into +0.0)."""
    bits = torch.where(x == 0, torch.zeros_like(x), x).view(torch.int32).long() & 0xFFFFFFFF
    return torch.where(bits >= 2**31, bits ^ 0xFFFFFFFF, bits ^ 0x80000000)


def _cases(gen, size):
    """(name, keys int64 [size] in [1, 2**32), ok bool [size]) edge cases for the threshold search (0 is the
    kernel's mark of a non-candidate)."""
    rnd = torch.randint(1, 2**32, (size,), generator=gen, dtype=torch.int64)
    some = torch.rand(size, generator=gen) < 0.7
    scores = torch.randn(size, generator=gen)
    scores[torch.rand(size, generator=gen) < 0.25] = float("inf")  # forced
    scores[torch.rand(size, generator=gen) < 0.25] = float("-inf")  # unscored: not a candidate
    yield "random", rnd, some
    yield "all-equal", torch.full((size,), 12345), torch.ones(size, dtype=torch.bool)
    yield "two-values", 1 + torch.randint(0, 2, (size,), generator=gen) * (2**32 - 2), some
    yield "extremes", torch.tensor([1, 2**32 - 1] * (size // 2)), torch.ones(size, dtype=torch.bool)
    yield "hash-range", 1 + torch.randint(0, 2**31, (size,), generator=gen, dtype=torch.int64), some
    yield "inf-mix", _ukey_ref(scores), torch.isfinite(scores) | (scores > 0)
    yield "few-ok", rnd, torch.rand(size, generator=gen) < 0.05
    yield "none-ok", rnd, torch.zeros(size, dtype=torch.bool)


def _check_threshold(keys, ok, need, uniform, dev, what):
    """The kernel's selection of the `need` largest ok keys against a stable descending sort (ties to the
    lower lane); its output is poisoned before the launch."""
    size = keys.shape[0]
    order = sorted((i for i in range(size) if ok[i]), key=lambda i: (-int(keys[i]), i))
    want = torch.zeros(size, dtype=torch.int8)
    want[order[:need]] = 1
    out = torch.full((size,), 7, dtype=torch.int8, device=dev)
    _threshold_probe[(1,)](keys.to(dev), ok.to(torch.int8).to(dev), torch.tensor([need], device=dev), out, S=size,
                           UNIFORM=uniform)
    assert torch.equal(out.cpu(), want), what


@pytest.mark.parametrize("uniform", [False, True], ids=["bisect", "bracketed"])
def test_threshold_matches_a_sort(uniform, gen, triton_device):
    # the register path's k-th largest search: needs from 0 to past the count on each case (every one on the
    # random keys); the bracketed search (probes around the quantile of uniform hashes first) must be exact on
    # any keys
    if triton is None:
        pytest.skip("triton")
    size = 32
    for name, keys, ok in _cases(gen, size):
        count = int(ok.sum())
        needs = range(count + 2) if name == "random" else {0, 1, count // 2, max(count - 1, 0), count, count + 3}
        for need in sorted(needs):
            _check_threshold(keys, ok, need, uniform, triton_device, f"{name}, need {need} of {count}")


@pytest.mark.parametrize("uniform", [False, True], ids=["bisect", "bracketed"])
def test_threshold_on_wide_hash_tiles(uniform, gen, triton_device):
    # stage C's shape: 31-bit hashes + 1 over a wide tile, some lanes kept (0); the bracket around the
    # quantile is narrow here, so the needs near the ends and the ties exercise both probe outcomes
    if triton is None:
        pytest.skip("triton")
    size = 2048
    keys = 1 + torch.randint(0, 2**31, (size,), generator=gen, dtype=torch.int64)
    keys[::97] = keys[5]  # a few equal hashes
    ok = torch.rand(size, generator=gen) < 0.8
    count = int(ok.sum())
    for need in (1, 7, count // 20, count // 2, count - 2, count):
        _check_threshold(keys, ok, need, uniform, triton_device, f"need {need} of {count}")


@pytest.mark.parametrize("batch,next_n,strided", [(0, 1, False), (1, 1, False), (5, 3, True), (1100, 2, False),
                                                   (7, 4, True)])
def test_dense_plan_counters_match_the_reference(batch, next_n, strided, gen, triton_device):
    """The shape-guarded plan's one launch (plan_triton.dense_plan_triton) writes what plan.dense_plan_ does:
    ceil(longest row / T) blocks (0 for empty rows) capped at the table's W = 70 (rows up to 5000 tokens: some
    past W x T, as plan(validate=False) may get), guarded True, update_rows False; rows past B untouched. 1100
    requests cross the kernel's 1024-request tile; strided lengths (a column slice) are read in place."""
    from spin_indexer.predictor.plan import dense_plan_
    from spin_indexer.predictor.plan_triton import dense_plan_triton
    lens = torch.randint(0, 5000, (batch, next_n + 1 if strided else next_n), generator=gen, dtype=torch.int32)
    lens[::3, 0] = 0  # empty rows and exact multiples of T
    lens[1::5, -1] = 2 * T
    lens = lens[:, 1:] if strided else lens
    lens[-1:] = T + 1  # one block and one token: the last request, whatever B
    cap = batch + 3  # the workspace's rows past B must stay as they were
    outs = {}
    for name, fn, dev in (("ref", dense_plan_, "cpu"), ("kernel", dense_plan_triton, triton_device)):
        blocks = torch.full((cap,), -7, dtype=torch.int32, device=dev)
        guarded = torch.zeros(cap, dtype=torch.bool, device=dev)
        update = torch.ones(cap, next_n, dtype=torch.bool, device=dev)
        fn(lens.to(dev), T, blocks[:batch], guarded[:batch], update[:batch], 70)
        outs[name] = [x.cpu() for x in (blocks, guarded, update)]
    for want, got in zip(outs["ref"], outs["kernel"]):
        assert torch.equal(want, got)
    blocks, guarded, update = outs["kernel"]
    assert torch.equal(blocks[:batch], ((lens.amax(dim=1) + T - 1) // T if batch else blocks[:0]).clamp(max=70).int())
    assert batch < 5 or int(lens.amax()) > 70 * T  # the cap was exercised
    assert bool(guarded[:batch].all()) and not bool(guarded[batch:].any())
    assert not bool(update[:batch].any()) and bool(update[batch:].all()) and bool((blocks[batch:] == -7).all())
