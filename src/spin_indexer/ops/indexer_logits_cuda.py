"""Paged indexer logits in CUDA for SM90 (csrc/paged_logits_sm90.cu), next_n 1-4: math warpgroups on key blocks
in turn, each refilling its own TMA stages, so that one block's MMA runs beside another's epilogue, which the
Triton kernel cannot do (issue #17). The logits op's "cuda" backend at next_n 2-4 where DeepGEMM does not serve
(`step_uses`, ops.logits_backend). Measured (H200, run 124, 96 x 128K, paired rounds): at next_n = 2 473 us
writing the logits only (DeepGEMM 434), 500 us with the block maxima; 736 / 786 at 3 / 4 (873 at 4 with maxima;
Triton 1009 / 1180); benchmarks/NOTES.md, runs 101-125.

Built with nvcc on first use into a cache folder (SPIN_CUDA_CACHE, default ~/.cache/spin_indexer), keyed by the
source's hash, and called through ctypes: no torch extension, no ninja. Where nvcc, an SM90 GPU or the build is
missing, `supports` answers False and callers keep the Triton kernel.

Same math and outputs as `paged_indexer_logits_triton(..., fill_tail=False)`: logits float32 [B*next_n, W*T]
and their block maxima [B*next_n, W]; blocks past each request's longest row are left as they were. Shapes it
takes: H = 64, D = 128, T = 64 (DeepSeek-V3.2's indexer), pages a whole number of 128-byte rows apart (V3.2's
8448 bytes and V4's 8704; not V4's 8640).
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from ..checks import check_tensor
from ..dispatch import forced_logits_backend
from ..layout import page_stride_bytes
from .indexer_logits import check_paged_indexer_args
from .indexer_logits_triton import logits_outputs

SOURCE = Path(__file__).with_name("csrc") / "paged_logits_sm90.cu"
NVCC_FLAGS = ("-O3", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a", "-shared", "-Xcompiler", "-fPIC")
HEADS, DIM, TOKENS = 64, 128, 64
MAX_CHUNK = 256  # blocks a CTA (the kernel stages their ids in shared memory)
ERRORS = {-1: "no cuTensorMapEncodeTiled in the driver", -2: "a TMA tensor map was rejected",
          -3: "the shared-memory attribute was refused", -4: "the launch failed", -5: "bad arguments",
          -6: "the inputs' device could not be made current"}


def nvcc_path() -> str | None:
    """nvcc on PATH, else under CUDA_HOME / CUDA_PATH / /usr/local/cuda; None if there is none."""
    found = shutil.which("nvcc")
    if found:
        return found
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root and os.access(os.path.join(root, "bin", "nvcc"), os.X_OK):
            return os.path.join(root, "bin", "nvcc")
    return None


def build(out_dir: str | os.PathLike | None = None, defines: tuple[str, ...] = ()) -> Path:
    """Compiles the kernel library (about 5 s) unless the cache holds it; returns its path. defines: -D
    switches (NAME=VALUE) of the source's probe builds (benchmarks/cuda_logits_probe.py; none in the library
    this module calls). Raises RuntimeError with nvcc's message when nvcc is missing or fails."""
    nvcc = nvcc_path()
    if nvcc is None:
        raise RuntimeError("nvcc not found (PATH, CUDA_HOME): the CUDA logits kernel cannot be built")
    src = SOURCE.read_bytes()
    flags = (*NVCC_FLAGS, *(f"-D{d}" for d in defines))
    digest = hashlib.sha256(src + " ".join(flags).encode()).hexdigest()[:16]
    folder = Path(out_dir or os.environ.get("SPIN_CUDA_CACHE") or Path.home() / ".cache" / "spin_indexer")
    folder.mkdir(parents=True, exist_ok=True)
    lib = folder / f"paged_logits_sm90_{digest}.so"
    if lib.exists():
        return lib
    with tempfile.TemporaryDirectory(dir=folder) as tmp:  # built aside, then renamed: no half-written library
        part = Path(tmp) / lib.name
        proc = subprocess.run([nvcc, *flags, "-o", str(part), str(SOURCE)], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"nvcc failed on {SOURCE.name}:\n{proc.stderr[-2000:]}")
        os.replace(part, lib)
    return lib


@functools.cache
def load_library(defines: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """The built library with its entry point typed; None where it does not build or load."""
    try:
        lib = ctypes.CDLL(str(build(defines=defines)))
        fn = lib.spin_paged_logits_sm90
    except (RuntimeError, OSError, AttributeError):  # AttributeError: a library without the entry point
        return None
    i32, i64, ptr = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [i32, ptr, ptr, i64, i64, ptr, ptr, ptr, i32, i32, i32, ptr, i64, ptr, i64, i32, ptr, i32, ptr]
    fn.restype = i32
    return lib


class FusedArgs(ctypes.Structure):
    """The kernel's FusedArgs (csrc/paged_logits_sm90.cu): group maxima and row 0's EMA update in the epilogue."""
    _fields_ = [("group_max", ctypes.c_void_p), ("gmax_stride", ctypes.c_int64), ("group", ctypes.c_int),
                ("v", ctypes.c_void_p), ("vb", ctypes.c_void_p), ("vb_stride", ctypes.c_int64),
                ("d", ctypes.c_void_p), ("d_stride", ctypes.c_int64), ("seen", ctypes.c_void_p),
                ("seen_stride", ctypes.c_int64), ("clock", ctypes.c_void_p), ("slot_ids", ctypes.c_void_p),
                ("kept", ctypes.c_void_p), ("kept_stride", ctypes.c_int64), ("lens", ctypes.c_void_p),
                ("upd", ctypes.c_void_p), ("alpha", ctypes.c_float), ("beta", ctypes.c_float),
                ("lo", ctypes.c_float), ("hi", ctypes.c_float), ("window", ctypes.c_int), ("trash", ctypes.c_int)]


# Whether SPIN's step computes its logits here with the EMA update fused into the epilogue (`fuses`) instead of
# running the update as a pass over the logits on a side stream. Unmeasured on the step: off unless
# SPIN_STEP_FUSED_UPDATE=1, until a paired A/B (benchmarks/update_overlap.py --variants spin,cudafused) says it wins.
STEP_FUSES_UPDATE = os.environ.get("SPIN_STEP_FUSED_UPDATE", "0") == "1"
FUSED_GROUPS = (16, 32, 64)  # group maxima the epilogue writes (64: the block maxima themselves)
# The fused build's one next_n: at 2 (row 0's update beside two rows' scores) it spilled registers and its step
# ran 0.86x the pass's (H100, run 133); at 3-4 it spilled more.
FUSED_NEXT_N = 1


def fuses(q_fp8: torch.Tensor, kv_cache: torch.Tensor, history, group: int) -> bool:
    """Whether the kernel takes this update in its epilogue (see `paged_indexer_logits_cuda(history=)`): the
    inputs it runs (`supports`) at next_n = 1, one updating row (history.rows == 1), a float16 history with V rows
    of T contiguous cells, and the top-k's group maxima at 16, 32 or 64 columns. A host rule on static shapes and
    dtypes."""
    if history is None or group not in FUSED_GROUPS or q_fp8.dim() != 4 or q_fp8.shape[1] != FUSED_NEXT_N:
        return False
    try:  # the layouts paged_indexer_logits_cuda(history=) takes (the table's width is checked there)
        _check_history(history, q_fp8.shape[0], 0, q_fp8.shape[1], q_fp8.device)
    except (TypeError, ValueError):
        return False
    return supports(q_fp8, kv_cache)


def step_fuses_update(q_fp8: torch.Tensor, kv_cache: torch.Tensor, history, group: int) -> bool:
    """Whether SPIN's step takes the fused epilogue (STEP_FUSES_UPDATE and `fuses`); SPIN_INDEXER_LOGITS other than
    cuda keeps the pass."""
    forced = forced_logits_backend()
    return STEP_FUSES_UPDATE and forced in (None, "cuda") and fuses(q_fp8, kv_cache, history, group)


def _fused_args(history, group_max_out: torch.Tensor | None, group: int) -> FusedArgs:
    """The FusedArgs of an update (history may be None: group maxima only)."""
    fa = FusedArgs()
    if group_max_out is not None and group < TOKENS:
        fa.group_max, fa.gmax_stride, fa.group = group_max_out.data_ptr(), group_max_out.stride(0), group
    if history is None:
        return fa
    h = history
    finfo = torch.finfo(h.vertical.dtype)
    fa.v, fa.vb, fa.vb_stride = h.vertical.data_ptr(), h.block_max.data_ptr(), h.block_max.stride(0)
    fa.d, fa.d_stride = h.diagonal.data_ptr(), h.diagonal.stride(0)
    if h.last_seen is not None:
        fa.seen, fa.seen_stride = h.last_seen.data_ptr(), h.last_seen.stride(0)
    fa.clock, fa.slot_ids = h.clock.data_ptr(), h.slot_ids.data_ptr()
    fa.kept, fa.kept_stride = h.kept_blocks.data_ptr(), h.kept_blocks.stride(0)
    fa.lens, fa.upd = h.seq_lens.data_ptr(), h.update_rows.data_ptr()
    # beta as torch computes (1.0 - alpha) * old: the difference in double, then float32
    fa.alpha, fa.beta, fa.lo, fa.hi = h.alpha, 1.0 - h.alpha, finfo.min, finfo.max
    fa.window, fa.trash = int(h.window), h.trash_block
    return fa


def _check_history(history, batch: int, width: int, next_n: int, dev: torch.device) -> None:
    """The layouts the fused epilogue reads for a table of B = batch rows, at least `width` of them kept ids
    (TypeError / ValueError naming the field)."""
    h = history
    check_tensor("history.vertical", h.vertical, dtype=torch.float16, ndim=2, device=dev)
    if h.vertical.shape[1] != TOKENS or h.vertical.stride() != (TOKENS, 1):
        raise ValueError(f"history.vertical: expected float16 [P + 1, {TOKENS}] with contiguous rows, got shape "
                         f"{list(h.vertical.shape)} strides {h.vertical.stride()}")
    check_tensor("history.block_max", h.block_max, dtype=torch.float16, shape=(h.vertical.shape[0],),
                 shape_names="[P + 1]", device=dev)
    check_tensor("history.diagonal", h.diagonal, dtype=torch.float16, ndim=2, device=dev)
    if h.diagonal.shape[1] != h.window + 1 or h.diagonal.stride(1) != 1:
        raise ValueError(f"history.diagonal: expected [S, window + 1 = {h.window + 1}] with contiguous rows, got "
                         f"shape {list(h.diagonal.shape)} strides {h.diagonal.stride()}")
    if h.last_seen is not None:
        check_tensor("history.last_seen", h.last_seen, dtype=torch.int32, shape=(h.vertical.shape[0],),
                     shape_names="[P + 1]", device=dev)
    check_tensor("history.clock", h.clock, dtype=torch.int32, shape=(1,), shape_names="[1]", device=dev)
    check_tensor("history.slot_ids", h.slot_ids, dtype=torch.int64, shape=(batch,), shape_names="[B]", device=dev,
                 contiguous=True)
    check_tensor("history.kept_blocks", h.kept_blocks, dtype=torch.int32, ndim=2, device=dev)
    if h.kept_blocks.shape[0] != batch or h.kept_blocks.shape[1] < width or h.kept_blocks.stride(1) != 1:
        raise ValueError(f"history.kept_blocks: expected int32 [B = {batch}, >= W = {width}] with contiguous rows, "
                         f"got shape {list(h.kept_blocks.shape)} strides {h.kept_blocks.stride()}")
    check_tensor("history.seq_lens", h.seq_lens, dtype=torch.int32, shape=(batch, next_n),
                 shape_names="[B, next_n]", device=dev, contiguous=True)
    check_tensor("history.update_rows", h.update_rows, dtype=torch.bool, shape=(batch, next_n),
                 shape_names="[B, next_n]", device=dev, contiguous=True)
    if h.rows != 1:
        raise ValueError(f"history.rows: the fused epilogue updates row 0 only (MtpPolicy.ROW0), got {h.rows}")


def step_uses(next_n: int) -> bool:
    """Whether the logits op picks this kernel at next_n where it runs (ops.logits_backend, after DeepGEMM):
    SPIN_INDEXER_LOGITS=cuda forces it at next_n 1-4, =triton / deepgemm / reference never; else next_n 2-4
    (faster there than the Triton kernel, runs 108-118; at next_n = 1 both read at copy bandwidth and the
    Triton kernel also writes the top-k's group maxima and the update in its epilogue). A host rule on static
    shapes."""
    forced = forced_logits_backend()
    if forced not in (None, "cuda") or not 1 <= next_n <= 4:
        return False
    return forced == "cuda" or next_n >= 2


def supports(q_fp8: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Whether this kernel runs these inputs: CUDA tensors on an SM90 GPU, next_n 1-4, H = 64, D = 128,
    T = 64, pages a whole number of 128-byte rows apart, and the library built."""
    if not (q_fp8.is_cuda and q_fp8.dim() == 4 and kv_cache.dim() == 4):
        return False
    _, next_n, heads, dim = q_fp8.shape
    if (heads, dim, kv_cache.shape[1]) != (HEADS, DIM, TOKENS) or not 1 <= next_n <= 4:
        return False
    if torch.cuda.get_device_capability(q_fp8.device) != (9, 0):
        return False
    try:
        if page_stride_bytes(kv_cache) % DIM:
            return False
    except ValueError:
        return False
    return load_library() is not None


# A CTA's start (the block ids, q, the first copies into an empty pipeline) costs about as much as 8 blocks: fit
# to chunk 128 taking 1.03x chunk 256's time (96 x 128K and 32 x 512K, paired rounds, run 116)
CTA_START_BLOCKS = 8


def default_chunk(batch: int, width: int, device: torch.device) -> int:
    """Blocks a CTA for a grid of batch x ceil(width / chunk) CTAs on this GPU (one CTA an SM fits): the one of
    8..256 (as even a split of the width as that count of chunks allows) that minimizes waves x (chunk +
    CTA_START_BLOCKS), i.e. the grid's time where every block costs alike. A last wave that fills a few SMs costs a
    whole one: 96 x 128K (2048 blocks a request) takes 187 blocks a CTA (8 full waves) instead of 256 (5.8 waves,
    the model's 1.5% more), 32 x 512K 249 instead of 256 (2.7%). Measured (run 118, paired rounds): half that:
    32 x 512K 1.9% faster at next_n = 2, 96 x 128K even at 2 and 1.1% slower at 4, 0.6-1.2% faster at 3-4."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count  # the inputs' GPU, not the current one
    return balanced_chunk(batch, width, sms)


@functools.lru_cache(maxsize=256)
def balanced_chunk(batch: int, width: int, sms: int) -> int:
    """default_chunk's rule for `sms` multiprocessors (a host rule on static shapes; cached)."""
    if width <= 8:
        return max(width, 1)
    best_cost, best = None, MAX_CHUNK
    for target in range(min(MAX_CHUNK, width), 7, -1):
        count = -(-width // target)  # chunks a request
        chunk = -(-width // count)   # the even split
        cost = -(-batch * count // sms) * (chunk + CTA_START_BLOCKS)
        if best_cost is None or cost < best_cost:
            best_cost, best = cost, chunk
    return best


def paged_indexer_logits_cuda(q_fp8: torch.Tensor, kv_cache: torch.Tensor, weights: torch.Tensor,
                              seq_lens: torch.Tensor, block_table: torch.Tensor, validate: bool = True,
                              out: torch.Tensor | None = None, block_max_out: torch.Tensor | None = None,
                              chunk: int | None = None, library: ctypes.CDLL | None = None,
                              group_max_out: torch.Tensor | None = None, group: int = 64,
                              history=None) -> torch.Tensor:
    """Paged indexer logits, blocks past each request's longest row left unwritten (as the Triton kernel with
    fill_tail=False). q_fp8: float8_e4m3fn [B, next_n, 64, 128]; kv_cache: uint8 [num_blocks, 64, 1, 132];
    weights: float32 [B*next_n, 64]; seq_lens: int32 [B, next_n]; block_table: int32 [B, W]; out: float32
    [B*next_n, W*64]; block_max_out: float32 [B*next_n, W], or None: the kernel built without the block maxima runs
    (logits only, as DeepGEMM's; 0.94-0.95x the time at next_n = 2, run 106); chunk: blocks a CTA (1-256; None:
    default_chunk).
    Ids outside the cache read block 0 (validate=False: wrong logits, never a read outside the cache).
    library: a probe build (`load_library(defines)`, benchmarks only); None = the production one.
    The fused epilogue (group_max_out=, history=) runs at next_n = 1 only (FUSED_NEXT_N).
    group_max_out, group: optional float32 [B*next_n, >= W*64 / group], the max of every `group` (16 or 32)
    columns below each request's longest row, as group_max_ref (a NaN kept); needs block_max_out.
    history: optional ops.HistoryUpdate with rows == 1 (block_table is then its compact table): row 0's EMA update
    applied in the epilogue from the scores it holds, as history.update_history_ref would after the logits (V,
    its block max, D inside the window, last_seen); needs block_max_out. Its block maxima (and group maxima)
    then keep a NaN, as group_max_ref does.
    Raises ValueError for inputs `supports` rejects. returns out: float32 [B*next_n, W*64]."""
    check_paged_indexer_args(q_fp8, kv_cache, weights, seq_lens, block_table, validate)
    if not supports(q_fp8, kv_cache):
        raise ValueError(f"q_fp8 / kv_cache: the CUDA logits kernel takes CUDA tensors on an SM90 GPU with next_n "
                         f"1-4, H = {HEADS}, D = {DIM}, T = {TOKENS} and pages a whole number of {DIM}-byte rows "
                         f"apart (and nvcc to build it); got q_fp8 {list(q_fp8.shape)} on {q_fp8.device}, kv_cache "
                         f"{list(kv_cache.shape)}")
    if chunk is not None and not 1 <= chunk <= MAX_CHUNK:
        raise ValueError(f"chunk: expected 1..{MAX_CHUNK} blocks a CTA, got {chunk}")
    batch, next_n = q_fp8.shape[:2]
    width = block_table.shape[1]
    fused = history is not None or group_max_out is not None
    if fused and next_n != FUSED_NEXT_N:
        raise ValueError(f"history= / group_max_out=: the fused epilogue runs at next_n = {FUSED_NEXT_N}, got "
                         f"q_fp8 with next_n = {next_n}")
    if fused and block_max_out is None:
        raise ValueError("block_max_out: the fused epilogue (history=, group_max_out=) writes the block maxima too: "
                         "expected a float32 [B*next_n, W] buffer, got None")
    if group_max_out is not None:
        if group not in (16, 32):
            raise ValueError(f"group: expected 16 or 32 columns a group maximum (64: block_max_out), got {group}")
        check_tensor("group_max_out", group_max_out, dtype=torch.float32, ndim=2, device=q_fp8.device,
                     device_of="q_fp8")
        if group_max_out.shape[0] != batch * next_n or group_max_out.shape[1] < width * TOKENS // group or \
                group_max_out.stride(1) != 1:
            raise ValueError(f"group_max_out: expected float32 [B*next_n = {batch * next_n}, >= W*64 / group = "
                             f"{width * TOKENS // group}] with contiguous rows, got shape "
                             f"{list(group_max_out.shape)} strides {group_max_out.stride()}")
    if history is not None:
        _check_history(history, batch, width, next_n, q_fp8.device)
    out, block_max_out = logits_outputs(q_fp8, kv_cache, block_table, out, block_max_out,
                                        maxima=block_max_out is not None)
    if batch == 0 or width == 0:
        return out
    q = q_fp8 if q_fp8.is_contiguous() else q_fp8.contiguous()
    w = weights if weights.is_contiguous() else weights.contiguous()
    lens = seq_lens if seq_lens.is_contiguous() else seq_lens.contiguous()
    if block_table.stride(1) != 1:
        block_table = block_table.contiguous()
    chunk = chunk or default_chunk(batch, width, q.device)
    stream = torch.cuda.current_stream(q.device).cuda_stream  # the library makes q's device its current one
    rc = (library or load_library()).spin_paged_logits_sm90(
        next_n, q.data_ptr(), kv_cache.data_ptr(), kv_cache.shape[0], page_stride_bytes(kv_cache), w.data_ptr(),
        lens.data_ptr(), block_table.data_ptr(), batch, width, block_table.stride(0), out.data_ptr(), out.stride(0),
        block_max_out.data_ptr() if block_max_out is not None else None,
        block_max_out.stride(0) if block_max_out is not None else 0, chunk,
        ctypes.byref(_fused_args(history, group_max_out, group)) if fused else None, q.device.index, stream)
    if rc != 0:
        raise RuntimeError(f"paged_indexer_logits_cuda: {ERRORS.get(rc, rc)}")
    return out
