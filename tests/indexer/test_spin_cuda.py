"""On a CUDA machine: SpinIndexer with the Triton twins equals SpinIndexer on the CPU reference, step by
step, and a whole multi-layer step captures and replays in a CUDA graph with the same result."""
import pytest
import torch

from conftest import make_paged_inputs
from spin_indexer.indexer import SpinIndexer
from spin_indexer.predictor import SpinConfig

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _pair(cfg, batch, width, next_n, layers):
    out = []
    for dev in ("cpu", "cuda"):
        idx = SpinIndexer(cfg, layers, batch, width, next_n=next_n, device=dev)
        slots = torch.tensor([idx.state.allocate() for _ in range(batch)], dtype=torch.int32, device=dev)
        out.append((idx, slots))
    return out


def _share_state(src, dst) -> None:
    """Every tensor of SpinState src copied into dst's (same shapes: both indexers built alike)."""
    for name, value in vars(src).items():
        if isinstance(value, torch.Tensor):
            getattr(dst, name).copy_(value)


@pytest.mark.parametrize("next_n", [1, 2])
@pytest.mark.parametrize("mtp", ["row0", "row-local"])
@pytest.mark.parametrize("summary,grain", [(0.0, "slot"), (0.5, "slot"), (0.0, "block")],
                         ids=["paper", "summary-mix", "block-grain"])
def test_cuda_step_matches_cpu_reference(next_n, mtp, summary, grain, gen):
    """The fused step (with the summary mix: plan() resets, run(layer) writes and scores the summary cache and
    selects in one launch) against the CPU's torch path, both planning from the same state each step (the GPU
    takes the CPU's history before plan(): histories written from fp8-MMA logits drift apart by rounding, and a
    drifted near-tie would flip a block whatever the kernels do). So the paper's plan must match exactly; the
    mix standardizes fp32 scores summed in another order (and its summary scores come from an fp8 MMA): a block
    at a near-tie may flip, two a step at most. Block grain: the block maxima are the history compared."""
    _check_step_matches_cpu(next_n, mtp, summary, 512, gen, grain)


@pytest.mark.parametrize("next_n", [2, 3])
@pytest.mark.parametrize("topk", [128, 64])
def test_cuda_kernel_group_maxima_in_the_step(next_n, topk, gen, monkeypatch):
    """The step on the CUDA logits kernel (forced: DeepGEMM would serve next_n = 2) with the top-k pruning at 16
    (topk 128) or 32 (topk 64) columns, whose group maxima the kernel writes from its block maxima's partials
    (no pass behind it): the same plans, top-k sets and history as the CPU reference, as above."""
    from spin_indexer.ops import indexer_logits_cuda
    if torch.cuda.get_device_capability() != (9, 0) or indexer_logits_cuda.load_library() is None:
        pytest.skip("needs an SM90 GPU and the CUDA logits library")
    monkeypatch.setenv("SPIN_INDEXER_LOGITS", "cuda")
    _check_step_matches_cpu(next_n, "row0", 0.0, topk, gen)


def _check_step_matches_cpu(next_n, mtp, summary, topk, gen, grain="slot"):
    lengths = (9000, 4100, 700)
    x = make_paged_inputs(lengths, next_n, 64, 128, gen, garbage=False)
    cfg = SpinConfig(sparsity=0.4, topk=topk, mtp=mtp, summary=summary, vertical_grain=grain)
    width = x.block_table.shape[1]
    (cpu, s_cpu), (gpu, s_gpu) = _pair(cfg, len(lengths), width, next_n, 2)
    xg = x.to("cuda")
    for step in range(4):
        w = torch.randn_like(x.weights)  # the query side moves every step
        _share_state(cpu.state, gpu.state)
        cpu.plan(x.block_table, x.seq_lens, s_cpu)
        gpu.plan(xg.block_table, xg.seq_lens, s_gpu)
        flipped = torch.zeros(cpu.state.block_max.shape[::-1], dtype=torch.bool)  # [L, blocks]: scored by one side
        for layer in range(2):
            a = cpu.run(layer, x.q_fp8, x.kv_cache, w)
            b = gpu.run(layer, xg.q_fp8, xg.kv_cache, w.cuda())
            differ = cpu.block_plan.keep_mask ^ gpu.block_plan.keep_mask.cpu()
            flips = int(differ.sum())
            assert flips <= (2 if summary else 0), (step, layer, flips)
            flipped[layer, x.block_table[differ].long()] = True
            # fp32 sums in another order may swap near-ties: compare as sets, demand near-total overlap (a
            # flipped block may move its 64 tokens in or out)
            for r in range(a.shape[0]):
                sa, sb = set(a[r].tolist()), set(b[r].cpu().tolist())
                assert len(sa ^ sb) <= 4 + 2 * 64 * flips, (step, layer, r, len(sa ^ sb))
        # The last block is the trash block of padding lanes: its content is unspecified. Logits differ by
        # summation order (tensor-core fp8 MMA vs fp32 CPU), so tolerance scales with the logits' magnitude. A
        # flipped block was scored (its history updated) on one side only: left out.
        keep = ~flipped[:, :-1, None]
        # the history: V per slot, or under block grain the block maxima ([L, blocks, 1])
        hist_cpu, hist_gpu = ((cpu.state.vertical, gpu.state.vertical) if grain == "slot" else
                              (cpu.state.block_max.t()[:, :, None], gpu.state.block_max.t()[:, :, None]))
        ref = torch.where(keep, hist_cpu[:, :-1].float(), 0.0)
        scale = ref[torch.isfinite(ref)].abs().max().item()
        got = torch.where(keep, hist_gpu[:, :-1].cpu().float(), 0.0)
        torch.testing.assert_close(got, ref, rtol=2e-2, atol=5e-3 * scale)


@pytest.mark.parametrize("summary,grain", [(0.0, "slot"), (0.5, "slot"), (0.0, "block")],
                         ids=["paper", "summary-mix", "block-grain"])
def test_whole_step_captures_in_a_cuda_graph(summary, grain, gen):
    lengths, next_n, layers = (20000, 13000), 1, 4
    x = make_paged_inputs(lengths, next_n, 64, 128, gen, garbage=False).to("cuda")
    cfg = SpinConfig(sparsity=0.5, topk=2048, summary=summary, vertical_grain=grain)
    idx = SpinIndexer(cfg, layers, 2, x.block_table.shape[1], next_n=next_n, device="cuda")
    slots = torch.tensor([idx.state.allocate() for _ in range(2)], dtype=torch.int32, device="cuda")
    outs = [torch.empty(2, 2048, dtype=torch.int32, device="cuda") for _ in range(layers)]

    def step():
        idx.plan(x.block_table, x.seq_lens, slots, validate=False)
        for layer in range(layers):
            outs[layer].copy_(idx.run(layer, x.q_fp8, x.kv_cache, x.weights))

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):  # warm-up: kernels compiled, history exists
            step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    eager = SpinIndexer(cfg, layers, 2, x.block_table.shape[1], next_n=next_n, device="cuda")
    for _ in range(2):
        eager.state.allocate()  # (clears its slots: copy the history after)
    names = ("vertical", "block_max", "diagonal", "last_seen", "step", "seen_len", "clock", "summaries",
             "summarized")
    for name in names:
        if getattr(idx.state, name) is not None:
            getattr(eager.state, name).copy_(getattr(idx.state, name))
    graph.replay()
    torch.cuda.synchronize()
    eager.plan(x.block_table, x.seq_lens, slots)
    for layer in range(layers):
        assert torch.equal(eager.run(layer, x.q_fp8, x.kv_cache, x.weights), outs[layer])
    for name in names:  # the trash block / trash offsets hold whatever dead lanes wrote
        if getattr(idx.state, name) is not None and name in ("vertical", "block_max", "last_seen"):
            assert torch.equal(getattr(eager.state, name)[:-1] if name != "vertical" else eager.state.vertical[:, :-1],
                               getattr(idx.state, name)[:-1] if name != "vertical" else idx.state.vertical[:, :-1]), name
    assert torch.equal(eager.state.diagonal[..., :-1], idx.state.diagonal[..., :-1])
    for name in ("step", "seen_len", "clock"):
        assert torch.equal(getattr(eager.state, name), getattr(idx.state, name)), name
