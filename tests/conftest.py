"""Shared test machinery: seeding, devices, the Triton interpreter switch, the odd-shape list, random paged
caches built byte by byte, and an independent float64 recomputation of the indexer logits.

Test modules import the helpers directly (`from conftest import make_paged_inputs, ...`): tests/ has no
__init__.py, so pytest puts this folder on sys.path. Keep a single conftest.py under tests/ (a nested one
would shadow the `conftest` module name).

Nothing here calls the package's own cache helpers: bytes are written with numpy and fp8 bytes are decoded
with a table built from the e4m3 bit layout, so the reference shares no code with the ops it checks.
"""
from __future__ import annotations

import hashlib
import os
import random
from dataclasses import dataclass

import numpy as np
import pytest
import torch

# Without CUDA the Triton twins can only run in the interpreter. TRITON_INTERPRET is read when a kernel is
# decorated, so it must be set before any test module imports a *_triton module. Interpreter tests run by
# default (no opt-in flag): they must stay tiny.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Each distinct interpreted launch also goes through Triton's compiler front end for sm_90 (tests/sm90_compile.py):
# a kernel that only the interpreter accepts fails here, not on the GPU. SPIN_SM90_COMPILE=0 turns it off.
if os.environ.get("TRITON_INTERPRET") == "1" and os.environ.get("SPIN_SM90_COMPILE", "1") != "0":
    import sm90_compile

    if sm90_compile.usable():
        sm90_compile.install()

try:  # hypothesis is a test dependency; keep examples few and without deadlines (2 CPU cores in CI)
    from hypothesis import HealthCheck, settings

    settings.register_profile("spin", max_examples=25, deadline=None, derandomize=False,
                              suppress_health_check=[HealthCheck.too_slow])
    settings.register_profile("thorough", max_examples=500, deadline=None)  # SPIN_HYPOTHESIS_PROFILE=thorough
    settings.load_profile(os.environ.get("SPIN_HYPOTHESIS_PROFILE", "spin"))
except ImportError:  # pragma: no cover - the [test] extra installs it
    pass

T = 64  # tokens per block; written out here rather than imported, on purpose
SCALE_BYTES = 4
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
# Interpreter tests run their larger cases only where the kernels compile (the GPU run of tests/ops,
# tests/predictor and tests/indexer on the H200), or here with SPIN_TESTS_FULL=1 (the CPU suite must stay
# well under 15 min on CI's 2 cores; the full case set in the interpreter takes ~10 min more there).
FULL_CASES = torch.cuda.is_available() or os.environ.get("SPIN_TESTS_FULL") == "1"


def cuda_only(*values, why: str, id: str | None = None):
    """A parametrize case of the full set only (FULL_CASES): in the interpreter it costs `why`, while the
    test's other cases reach the same code on the CPU. Skipped otherwise with that reason, so the -ra
    summary lists every one of them."""
    return pytest.param(*values, id=id, marks=pytest.mark.skipif(
        not FULL_CASES, reason=f"CUDA only (or SPIN_TESTS_FULL=1): {why}"))


# ----------------------------------------------------------------------------------------------- seeding
def seed_of(text: str) -> int:
    """A stable 31-bit seed from a string (the test id), identical across runs and machines."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "little") & 0x7FFFFFFF


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    """One intra-op thread: the suite runs many small tensors, where a second thread spin-waits (replay
    tests went from 44 s to 3.3 s on a busy 2-core machine)."""
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed_everything(request):
    """Every test starts from a seed derived from its own id: reruns reproduce, tests stay independent."""
    seed = seed_of(request.node.nodeid)
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)
    return seed


@pytest.fixture
def gen(_seed_everything) -> torch.Generator:
    """A CPU torch.Generator seeded from the test id."""
    return torch.Generator().manual_seed(_seed_everything)


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    """Every available device: cpu here, cpu and cuda on the GPU box."""
    return request.param


@pytest.fixture
def triton_device() -> str:
    """The device a Triton twin runs on: cuda, or cpu under TRITON_INTERPRET=1; skips without triton."""
    pytest.importorskip("triton")
    return "cuda" if torch.cuda.is_available() else "cpu"


# --------------------------------------------------------------------------------------- odd-shape list
@dataclass(frozen=True)
class Case:
    """One indexer problem. lengths[b] is L_b, the context of request b including this step's newest token."""
    name: str
    lengths: tuple[int, ...]
    next_n: int = 1
    heads: int = 8
    dim: int = 128
    k: int = 64
    extra_width: int = 1  # block-table columns past the longest request (hold garbage)

    @property
    def batch(self) -> int:
        return len(self.lengths)


ODD_SHAPES = [
    Case("one-block", (64,), k=16),
    Case("one-token", (1,), k=8, dim=32),
    Case("partial-last-block", (130, 70), next_n=2, dim=32, k=32),
    Case("context-lt-k", (50, 100), heads=64, k=128),
    Case("next_n-4", (200, 7), next_n=4, dim=16, k=48),
    Case("next_n-2-h64", (300,), next_n=2, heads=64, k=100),
    Case("exact-blocks-h64", (128, 192), heads=64, dim=64, k=200, extra_width=0),
    Case("empty-batch", (), next_n=2, k=8),
    Case("next_n-3", (129, 64, 1), next_n=3, dim=32, k=40),  # MTP draft 2; the 1-token request has empty rows
]
ODD_IDS = [c.name for c in ODD_SHAPES]


# ----------------------------------------------------------------------------------------- fp8 decoding
def _e4m3fn_table() -> np.ndarray:
    """float64 value of every fp8 e4m3fn byte, from the bit layout: s eeee mmm, bias 7, no inf,
    S.1111.111 is NaN, exponent 0 is subnormal (m/8 * 2^-6)."""
    table = np.empty(256, dtype=np.float64)
    for byte in range(256):
        sign = -1.0 if byte & 0x80 else 1.0
        exp, man = (byte >> 3) & 0xF, byte & 0x7
        if exp == 0xF and man == 0x7:
            table[byte] = np.nan
        elif exp == 0:
            table[byte] = sign * (man / 8.0) * 2.0 ** -6
        else:
            table[byte] = sign * (1.0 + man / 8.0) * 2.0 ** (exp - 7)
    return table


E4M3FN = _e4m3fn_table()


def fp8_bytes(t: torch.Tensor) -> np.ndarray:
    """The raw bytes of an fp8 (or uint8) tensor as a numpy uint8 array of the same shape."""
    return t.detach().cpu().contiguous().view(torch.uint8).numpy()


def decode_fp8(t: torch.Tensor) -> np.ndarray:
    """float64 values of an fp8 e4m3fn tensor, decoded from its bytes with E4M3FN."""
    return E4M3FN[fp8_bytes(t)]


def split_cache_bytes(kv_cache: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Raw cache bytes -> (value bytes uint8 [num_blocks, T, D], scales float32 [num_blocks, T]).

    Per block: T*D value bytes, token-major, then T little-endian fp32 scales (REFERENCE.md section 2).
    """
    raw = kv_cache.detach().cpu().contiguous().numpy()
    num_blocks, tokens, _, row = raw.shape
    dim = row - SCALE_BYTES
    flat = raw.reshape(num_blocks, tokens * row)
    values = flat[:, : tokens * dim].reshape(num_blocks, tokens, dim)
    scales = np.ascontiguousarray(flat[:, tokens * dim :]).view("<f4").reshape(num_blocks, tokens)
    return values, scales


def dequantize_f64(kv_cache: torch.Tensor) -> np.ndarray:
    """Every cached key as float64 [num_blocks, T, D] = fp8 value * scale, from the raw bytes."""
    values, scales = split_cache_bytes(kv_cache)
    return E4M3FN[values] * scales.astype(np.float64)[..., None]


# ------------------------------------------------------------------------------------ float64 reference
def logits_f64(q_fp8, kv_cache, weights, seq_lens, block_table) -> tuple[np.ndarray, np.ndarray]:
    """Independent recomputation of the paged indexer logits, one position at a time in float64.

    returns (logits [B*next_n, W*T] float64 with -inf at or past each row's length,
             magnitude [B*next_n, W*T]: the same sum over absolute values, the scale for tolerances).
    """
    q = decode_fp8(q_fp8)  # [B, N, H, D]
    batch, next_n = q.shape[:2]
    w = weights.detach().cpu().double().numpy().reshape(batch, next_n, q.shape[2])  # [B, N, H]
    lens = seq_lens.detach().cpu().numpy().astype(np.int64)
    table = block_table.detach().cpu().numpy().astype(np.int64)
    values, scales = split_cache_bytes(kv_cache)
    tokens = values.shape[1]
    cols = table.shape[1] * tokens
    out = np.full((batch * next_n, cols), -np.inf)
    mag = np.zeros((batch * next_n, cols))
    for b in range(batch):
        for p in range(int(lens[b].max(initial=0))):
            block, slot = table[b, p // tokens], p % tokens  # logical position -> physical slot
            key = E4M3FN[values[block, slot]]  # [D]
            scale = float(scales[block, slot])
            dots = q[b] @ key  # [N, H]
            absdots = np.abs(q[b]) @ np.abs(key)
            for j in range(next_n):
                if p < lens[b, j]:
                    out[b * next_n + j, p] = scale * np.sum(w[b, j] * np.maximum(dots[j], 0.0))
                    mag[b * next_n + j, p] = scale * np.sum(np.abs(w[b, j]) * absdots[j])
    return out, mag


# Hopper's FP8 MMA keeps about 14 mantissa bits in its accumulator (DeepSeek-V3 report, sec. 3.3.2), so
# on CUDA the Triton kernel's dot products are only that exact; measured worst on the H200: 4.5e-5 x magnitude.
FP8_MMA_RTOL = 2.0 ** -13
FP32_RTOL = 2e-5


def assert_logits_close(actual: torch.Tensor, expected: np.ndarray, magnitude: np.ndarray,
                        rtol: float | None = None) -> None:
    """float32 logits vs the float64 recomputation: -inf exactly where expected, and elsewhere
    |actual - expected| <= rtol * magnitude (+ a denormal floor), magnitude being the sum of |terms|.
    rtol defaults to fp32 accumulation (CPU, interpreter) or the FP8 MMA's accumulator (CUDA)."""
    if rtol is None:
        rtol = FP8_MMA_RTOL if actual.is_cuda else FP32_RTOL
    got = actual.detach().cpu().double().numpy()
    assert got.shape == expected.shape, f"shape {got.shape} != {expected.shape}"
    want_inf = np.isneginf(expected)
    np.testing.assert_array_equal(np.isneginf(got), want_inf, err_msg="-inf mask differs")
    assert np.isfinite(got[~want_inf]).all(), "non-finite logits at valid positions"
    err = np.abs(got[~want_inf] - expected[~want_inf])
    bound = (rtol * magnitude + 1e-30)[~want_inf]
    worst = np.argmax(err - bound) if err.size else 0
    assert (err <= bound).all(), f"logits off by {err.flat[worst]:.3e} > {bound.flat[worst]:.3e}"


# ------------------------------------------------------------------------------------- random inputs
def row_lengths(lengths, next_n: int) -> torch.Tensor:
    """seq_lens int32 [B, next_n]: row j of request b has L_b - next_n + j + 1 tokens (floored at 0)."""
    j = torch.arange(next_n, dtype=torch.int64)
    lens = torch.tensor(list(lengths), dtype=torch.int64).reshape(-1, 1)
    return (lens - next_n + j[None, :] + 1).clamp_min(0).to(torch.int32).reshape(len(lengths), next_n)


def random_fp8(shape, gen: torch.Generator, spread: float = 1.0) -> torch.Tensor:
    """Finite fp8 e4m3fn values: normal * 2**U(-spread, spread) per element, cast by torch."""
    x = torch.randn(shape, generator=gen) * torch.exp2((torch.rand(shape, generator=gen) * 2 - 1) * spread)
    return x.to(torch.float8_e4m3fn)


def build_cache_bytes(values_u8: np.ndarray, scales_f32: np.ndarray) -> torch.Tensor:
    """A cache uint8 [num_blocks, T, 1, D + 4] laid out by hand from value bytes [num_blocks, T, D] and
    fp32 scales [num_blocks, T]: per block T*D value bytes then T*4 scale bytes (little endian)."""
    num_blocks, tokens, dim = values_u8.shape
    blocks = [np.concatenate([values_u8[i].reshape(-1).astype(np.uint8),
                              np.asarray(scales_f32[i], dtype="<f4").view(np.uint8).reshape(-1)])
              for i in range(num_blocks)]
    raw = np.stack(blocks) if blocks else np.zeros((0, tokens * (dim + SCALE_BYTES)), np.uint8)
    return torch.from_numpy(raw.reshape(num_blocks, tokens, 1, dim + SCALE_BYTES).copy())


def random_cache(num_blocks: int, dim: int, gen: torch.Generator, tokens: int = T) -> torch.Tensor:
    """A cache full of finite random keys: fp8 values and power-of-two scales 2^[-12, -1] per token."""
    values = fp8_bytes(random_fp8((num_blocks, tokens, dim), gen, spread=2.0))
    exps = torch.randint(-12, 0, (num_blocks, tokens), generator=gen).numpy()
    return build_cache_bytes(values, np.ldexp(1.0, exps).astype(np.float32))


GARBAGE_IDS = (-1, 2**31 - 1, -(2**31), 10**6)


def random_block_table(lengths, num_blocks: int, width: int, gen: torch.Generator,
                       garbage: bool = True) -> torch.Tensor:
    """block_table int32 [B, width]: each request's used blocks are distinct physical ids taken from a
    random permutation of range(num_blocks); columns past a request's used blocks hold garbage ids
    (-1, huge, negative) that every op must ignore (or 0 when garbage=False)."""
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    table = torch.zeros(len(lengths), width, dtype=torch.int32)
    for b, length in enumerate(lengths):
        used = -(-length // T)
        table[b, :used] = torch.tensor(perm[:used], dtype=torch.int32)
        perm = perm[used:]
        for c in range(used, width):
            pick = int(torch.randint(len(GARBAGE_IDS), (1,), generator=gen))
            table[b, c] = GARBAGE_IDS[pick] if garbage else 0
    return table


@dataclass
class PagedInputs:
    q_fp8: torch.Tensor  # float8_e4m3fn [B, N, H, D]
    kv_cache: torch.Tensor  # uint8 [num_blocks, T, 1, D + 4]
    weights: torch.Tensor  # float32 [B*N, H]
    seq_lens: torch.Tensor  # int32 [B, N]
    block_table: torch.Tensor  # int32 [B, W]

    def args(self):
        return self.q_fp8, self.kv_cache, self.weights, self.seq_lens, self.block_table

    def to(self, device) -> "PagedInputs":
        return PagedInputs(*(t.to(device) for t in self.args()))


def make_paged_inputs(lengths, next_n: int, heads: int, dim: int, gen: torch.Generator,
                      extra_width: int = 1, spare_blocks: int = 2, garbage: bool = True) -> PagedInputs:
    """A random decode step: permuted block tables with garbage past the used blocks, `spare_blocks`
    unused physical blocks full of random keys, seq_lens [B, next_n] from row_lengths(lengths, next_n)."""
    lengths = tuple(int(x) for x in lengths)
    used = sum(-(-x // T) for x in lengths)
    num_blocks = used + spare_blocks
    width = max([-(-x // T) for x in lengths], default=0) + extra_width
    batch = len(lengths)
    return PagedInputs(
        q_fp8=random_fp8((batch, next_n, heads, dim), gen),
        kv_cache=random_cache(num_blocks, dim, gen),
        weights=torch.randn(batch * next_n, heads, generator=gen),
        seq_lens=row_lengths(lengths, next_n),
        block_table=random_block_table(lengths, num_blocks, width, gen, garbage=garbage),
    )


def make_case_inputs(case: Case, gen: torch.Generator, garbage: bool = True) -> PagedInputs:
    return make_paged_inputs(case.lengths, case.next_n, case.heads, case.dim, gen,
                             extra_width=case.extra_width, garbage=garbage)


def run_logits_poisoned(launch, inputs: PagedInputs, device, **knobs) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, block_max_out) of a paged-logits launcher (`launch(q, cache, w, lens, table, out=, block_max_out=,
    **knobs)`) that wrote into NaN-poisoned buffers, so an element the kernel skips cannot pass; it must
    return the buffer it was given."""
    args = [t.to(device) for t in inputs.args()]
    rows = args[0].shape[0] * args[0].shape[1]
    width = args[4].shape[1]
    out = torch.full((rows, width * T), float("nan"), device=device)
    bmax = torch.full((rows, width), float("nan"), device=device)
    assert launch(*args, out=out, block_max_out=bmax, **knobs) is out
    return out, bmax


def check_lengths_past_the_table(launch, device, next_n: int, heads: int, dim: int, gen: torch.Generator,
                                 **knobs) -> None:
    """A paged-logits launcher called with validate=False on rows longer than its table (W = 4 blocks; the last
    request holds 5 x T + 7 tokens) writes what the same call with the lengths capped at W x T writes, bit for
    bit: it reads no id past a row (the table is a view of a 6-wide one whose columns 4-5 hold that request's
    next used blocks) and writes no logit or block max past its rows (the outputs are the leading rows of
    NaN-poisoned buffers one request taller, whose last rows must stay NaN)."""
    x = make_paged_inputs((3 * T, 5 * T + 7), next_n, heads, dim, gen, extra_width=0)
    wide = x.block_table.to(device)
    assert wide.shape[1] == 6
    view = wide[:, :4]
    lens = x.seq_lens.to(device)
    rows = 2 * next_n
    outs = []
    for table, lengths in ((view, lens), (view.contiguous(), lens.clamp(max=4 * T))):
        args = [t.to(device) for t in (x.q_fp8, x.kv_cache, x.weights)] + [lengths, table]
        out = torch.full((rows + next_n, 4 * T), float("nan"), device=device)
        bmax = torch.full((rows + next_n, 4), float("nan"), device=device)
        assert launch(*args, validate=False, out=out[:rows], block_max_out=bmax[:rows], **knobs) is not None
        outs.append((out.cpu(), bmax.cpu()))
    (out, bmax), (want, want_bmax) = outs
    assert not out[next_n:rows].isnan().any()  # the long request: every column a logit (the table's width)
    assert out[rows:].isnan().all() and bmax[rows:].isnan().all()  # nothing written past the rows
    assert torch.equal(out.nan_to_num(7.0), want.nan_to_num(7.0))
    assert torch.equal(bmax.nan_to_num(7.0), want_bmax.nan_to_num(7.0))


def masked_logits(rows: int, cols: int, gen: torch.Generator, ties: bool = False):
    """Random top-k input: logits float32 [rows, cols] (few distinct values when ties) and
    lengths int32 [rows] in [0, cols], with the masked tail filled with +inf/NaN/huge poison."""
    if ties:
        logits = torch.randint(-3, 3, (rows, cols), generator=gen).float()
    else:
        logits = torch.randn(rows, cols, generator=gen)
    lengths = torch.randint(0, cols + 1, (rows,), generator=gen).to(torch.int32)
    poison = torch.tensor([float("inf"), float("nan"), 1e30])
    pick = torch.randint(0, 3, (rows, cols), generator=gen)
    tail = torch.arange(cols)[None, :] >= lengths.long()[:, None]
    logits = torch.where(tail, poison[pick], logits)
    return logits, lengths


def tiny_llama(max_len: int = 1024, seed: int = 0):
    """A tiny random SmolLM2-shaped Llama (vocab 40, 2 layers, 4 heads) for model-path tests: weights
    N(0, 0.3) after torch.manual_seed(seed), eval mode, no grad."""
    from spin_indexer.model.llama import Llama, LlamaConfig

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=40, dim=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, ffn_dim=48)
    model = Llama(cfg, max_len=max_len).eval().requires_grad_(False)
    for p in model.parameters():
        p.normal_(0, 0.3)
    return model


def run_benchmark_dry(script: str, args: list, timeout: int):
    """benchmarks/<script> as a CPU dry run (SPIN_BENCH_DEVICE=cpu, Triton interpreted, src and benchmarks
    on the path), in a subprocess: the CompletedProcess, stdout and stderr captured as text."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, SPIN_BENCH_DEVICE="cpu", TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join([str(root / "src"), str(root / "benchmarks")]))
    return subprocess.run([sys.executable, str(root / "benchmarks" / script), *map(str, args)], env=env,
                          capture_output=True, text=True, timeout=timeout)


def write_variant(module, line: str, replacement: str | None, folder):
    """A copy of source file `module` (a Path) in `folder`, under the same name, with its one `line` replaced by
    `replacement` (None: an unchanged copy): the variant file an A/B script (benchmarks/select_ab.py, topk_ab.py)
    checks before it times it. Fails the calling test if `line` does not occur exactly once."""
    source = module.read_text()
    assert source.count(line) == 1, f"{module.name}: the line {line!r} moved or repeats; update the test's copy"
    variant = folder / module.name
    variant.write_text(source if replacement is None else source.replace(line, replacement))
    return variant


def import_benchmark(name: str):
    """The module benchmarks/<name>.py, imported with benchmarks/ on sys.path only for the import (it stays
    in sys.modules: a second call returns the same module)."""
    import importlib
    import sys
    from pathlib import Path

    bench = str(Path(__file__).resolve().parents[1] / "benchmarks")
    sys.path.insert(0, bench)
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(bench)


# ------------------------------------------------------------------------------ vLLM tests' isolation
@pytest.fixture(autouse=True)
def _vllm_cpu(request, monkeypatch):
    """Every test of a module that imports the vLLM harness (`import vllm_harness as vh`, tests/integrations)
    runs with no SPIN_* settings from the environment, vLLM's logits call on the flattened torch fallback and
    the plugin registered (vllm_harness.isolate). Here, not in a tests/integrations/conftest.py: a second
    module named conftest would shadow this one for the `from conftest import ...` of the other tests."""
    harness = getattr(request.module, "vh", None)
    if harness is not None and getattr(harness, "__name__", "") == "vllm_harness":
        harness.isolate(monkeypatch)


# ------------------------------------------------------------------------------------------- padded pages
POISON = 0xFF  # e4m3fn NaN as a key byte, and 0xFFFFFFFF is a float32 NaN as a scale


def padded(kv_cache: torch.Tensor, pad: int, poison: int = POISON, lead: int = 0, device=None) -> torch.Tensor:
    """The same pages `pad` bytes further apart, in a fresh allocation on `device` (default: kv_cache's) whose
    padding (and `lead` bytes before the first page) hold `poison`; returns the view uint8 [num_blocks, T, 1,
    D + 4] with stride(0) = page + pad. Build it on the device the kernel runs on: moving such a view with
    .to() copies it into contiguous pages, and the padding is gone."""
    num_blocks, tokens, _, row = kv_cache.shape
    page = tokens * row
    store = torch.full((lead + num_blocks * (page + pad),), poison, dtype=torch.uint8,
                       device=kv_cache.device if device is None else device)
    pages = torch.as_strided(store, (num_blocks, page), (page + pad, 1), lead)
    pages.copy_(kv_cache.reshape(num_blocks, page))
    return torch.as_strided(store, (num_blocks, tokens, 1, row), (page + pad, row, row, 1), lead)
