// Paged indexer logits for SM90 (H100 / H200) in CUDA: math warpgroups on key blocks in turn, each feeding itself
// with TMA. The logits op's "cuda" backend at next_n 2-4 where DeepGEMM does not serve (ops.logits_backend).
//
// Why CUDA and not Triton: Triton 3.6 waits for every MMA right after issuing it (wgmma.wait_group 0; a dot
// is asynchronous only when it accumulates into itself across iterations), so inside one program the MMA and
// the epilogue (ReLU, weights, the head sum for next_n rows) run in series, and its automatic warp
// specialization measured 2.4x slower (benchmarks/NOTES.md, runs 99-100). Here a CTA holds math warpgroups
// that take key blocks in turn (see Shape: four on whole blocks at next_n <= 2, two at 3, four in two row groups
// at 4), each block set refilling its own stages (2-4, Shape::SPW): while some wait for their MMA, others run their
// epilogues. What decides the time: the epilogue's instructions (a block's MMA is 256-512 tensor-core cycles, its
// epilogue 220-400 instructions of one warp an SMSP, issued one every ~3.5 cycles where that warp is alone: ncu,
// run 113) and the clock, which at the H200's power limit falls with the instructions issued (run 113). So the
// epilogue is written for few instructions a block (a reduce-scatter over the quad instead of a butterfly,
// block-max partials reduced once after the loop, uniform descriptors). H200, paired rounds under sustained load
// (run 124): next_n = 2 at 1.07-1.09x DeepGEMM writing the logits only, as DeepGEMM does (1.14-1.15x with the
// block maxima SPIN's step reads), 3 / 4 at 1.80x / 1.43-1.44x the max of the copy and MMA floors (1.58-1.60x at 4
// with maxima). A build with one instruction a score (AbsSum, SPIN_LOGITS_ABS_SUM=1) is faster at next_n 3-4 and
// less exact where scores cancel: see AbsSum.
//
// Math (as indexer_logits.paged_indexer_logits_ref): logits[b * next_n + j, t] = scale[t] *
// sum_h w[b * next_n + j, h] * relu(k[t] . q[b, j, h]), -inf where t >= seq_lens[b, j]; block_max[r, blk] = the
// max of block blk's 64 written logits (where the caller gives block_max: with a null pointer the kernel built
// without them runs, which writes the logits only, as DeepGEMM's does: 0.94-0.95x the time at next_n = 2, run 124);
// group_max[r, g] (with block_max, group = 16 or 32) the max of columns [group * g, group * (g + 1)), the top-k's
// group maxima where it prunes finer than a block, from the same partials after the loop (no pass over the logits
// behind the kernel). A NaN logit makes its block's and group's max NaN. Blocks past a request's longest row are
// not written (fill_tail=False).
// Shapes: H = 64 heads, D = 128, T = 64 tokens a block, next_n 1-4; the key cache uint8 [num_blocks, 64, 1, 132]
// (pages of 64 x 128 key bytes then 64 fp32 scales, a whole number of 128-byte rows apart).
//
// Layout of one math step (wgmma m64nNk32, N = next_n * 64): tokens on M (the key tile, A), (row, head) pairs
// on N (q, B), both K-major in shared memory with the 128-byte swizzle TMA writes. A thread's accumulators
// hold, for n8 tile i, D[r0][8i + 2c + {0, 1}] and D[r0 + 8][...] with r0 = 16 * warp + lane / 4, c = lane % 4:
// a row's 64 heads are 8 tiles, so a thread sums 16 of them and a quad (4 lanes) the 64.
#include <cuda.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <type_traits>

// Build-time switches for benchmarks/cuda_logits_probe.py only (the library's build, ops/, sets none):
// SPIN_LOGITS_PROBE leaves one stage out to time the rest (1: the epilogue's head sum, 2: the MMA; the block maxima:
// the MAXIMA = false build, a null block_max); SPIN_LOGITS_MATH_WG sets the math warpgroups an SM (default 0: see
// Shape), SPIN_LOGITS_ROW_GROUPS how many warpgroups share a block's rows at next_n 3-4 (1 to next_n; default 0: 2
// at next_n = 4, see Shape), both also per next_n (SPIN_LOGITS_MATH_WG_N3 / _N4, SPIN_LOGITS_ROW_GROUPS_N3 / _N4: 6
// warpgroups fit next_n = 3's registers at one row each, not next_n = 2's), SPIN_LOGITS_CTAS_PER_SM how many CTAs
// share the warpgroups (1 or 2), SPIN_LOGITS_STAGES_PER_WG the key blocks each block set keeps in flight (default 0:
// per next_n, see Shape::SPW); SPIN_LOGITS_PIPELINE (0 / 1) whether a block's last steps wait for the next block's
// MMA (default: at next_n 3-4, see the kernel); SPIN_LOGITS_UNROLL (0 / 1, default 1) whether the loop is unrolled
// by stages, SPIN_LOGITS_PER_WG (0 / 1; default: 0 at next_n = 2, else 1) whether it is compiled once per warpgroup
// (constant stage offsets, at the price of more code: see the kernel), SPIN_LOGITS_UNIFORM_WG (0 / 1, default 1)
// whether the loop compiled once takes the warpgroup index broadcast. SPIN_LOGITS_ABS_SUM, SPIN_LOGITS_WEIGHTS_SMEM
// and SPIN_LOGITS_ROW_PIPE: below.
#ifndef SPIN_LOGITS_PROBE
#define SPIN_LOGITS_PROBE 0
#endif
#ifndef SPIN_LOGITS_MATH_WG
#define SPIN_LOGITS_MATH_WG 0
#endif
#ifndef SPIN_LOGITS_MATH_WG_N3  // per next_n (3, 4): MATH_WG and ROW_GROUPS for one next_n only
#define SPIN_LOGITS_MATH_WG_N3 SPIN_LOGITS_MATH_WG
#endif
#ifndef SPIN_LOGITS_MATH_WG_N4
#define SPIN_LOGITS_MATH_WG_N4 SPIN_LOGITS_MATH_WG
#endif
#ifndef SPIN_LOGITS_ROW_GROUPS
#define SPIN_LOGITS_ROW_GROUPS 0
#endif
#ifndef SPIN_LOGITS_ROW_GROUPS_N3
#define SPIN_LOGITS_ROW_GROUPS_N3 SPIN_LOGITS_ROW_GROUPS
#endif
#ifndef SPIN_LOGITS_ROW_GROUPS_N4
#define SPIN_LOGITS_ROW_GROUPS_N4 SPIN_LOGITS_ROW_GROUPS
#endif
#ifndef SPIN_LOGITS_CTAS_PER_SM
#define SPIN_LOGITS_CTAS_PER_SM 1
#endif
#ifndef SPIN_LOGITS_PIPELINE
#define SPIN_LOGITS_PIPELINE -1
#endif
#ifndef SPIN_LOGITS_STAGES_PER_WG
#define SPIN_LOGITS_STAGES_PER_WG 0
#endif
#ifndef SPIN_LOGITS_UNROLL
#define SPIN_LOGITS_UNROLL 1
#endif
#ifndef SPIN_LOGITS_PER_WG
#define SPIN_LOGITS_PER_WG -1
#endif
#ifndef SPIN_LOGITS_UNIFORM_WG
#define SPIN_LOGITS_UNIFORM_WG 1
#endif
#ifndef SPIN_LOGITS_ABS_SUM  // the head sum through ReLU (0, the default) or through |s| (1: see AbsSum below)
#define SPIN_LOGITS_ABS_SUM 0
#endif
// SPIN_LOGITS_WEIGHTS_SMEM (0 / 1; default -1: on where three or more warpgroups take whole blocks at next_n 3-4:
// the library's next_n = 3): the epilogue reads the rows' weights from shared memory a block (4 16-byte loads a
// row) instead of holding them in registers (16 a row), so three warpgroups on whole blocks fit next_n = 3's 96 and
// next_n = 4's 128 accumulators in 168 registers (with the weights in registers next_n = 3 spills: run 125)
#ifndef SPIN_LOGITS_WEIGHTS_SMEM
#define SPIN_LOGITS_WEIGHTS_SMEM -1
#endif
// SPIN_LOGITS_ROW_PIPE (0 / 1, default 0): on whole blocks (one row group) at next_n >= 2, one MMA a row (N = 64), each
// its own commit group, and the next block's row j issued as soon as this block's row j is summed: a warpgroup's
// epilogue then runs beside its own MMAs (see the kernel's row-pipelined loop)
#ifndef SPIN_LOGITS_ROW_PIPE
#define SPIN_LOGITS_ROW_PIPE 0
#endif

namespace {

constexpr int T = 64;             // tokens a block
constexpr int D = 128;            // key bytes a token
constexpr int H = 64;             // heads
constexpr int KEY_BYTES = T * D;  // 8192: a stage's key tile (1024-aligned, as the 128-byte swizzle needs)
constexpr int SCALE_BYTES = T * 4;

// AbsSum: the head sum with one instruction a score instead of two. relu(s) = (s + |s|) / 2, so
//     sum_h w_h relu(s_h) = 1/2 sum_h w_h |s_h| + 1/2 (sum_h w_h q_h) . k:
// the first sum is one FFMA a score (ptxas folds the |.| into the FFMA's operand; ReLU then weight took FMNMX +
// FFMA), and the second is one more dot product with the row's weighted query q_w = sum_h w_h q_h, which the MMA
// computes beside the heads: q_w (fp32, in the prologue) is written as TERMS FP8 terms, q_w ~ sum_t sigma_t e_t
// with sigma_t a power of two (e_t = the e4m3 rounding of the residual / sigma_t, the residual's max at [128, 256)),
// so each term keeps 4 significant bits of what the previous ones left: 4 terms leave ~2^-16 of |q_w|, element by
// element. Error (terms of `magnitude` = scale * sum_h |w_h| |q_h| . |k|, as the tests bound it): the MMA's
// accumulator (~2^-14 of each dot product's |terms|) reaches both halves once, each halved: about 2^-14 of the
// magnitude as before, plus 2^-17 for the terms, inside FP8_MMA_RTOL = 2^-13. The cost: 8 more MMA columns a pair of
// rows (N = 72 / 136 / 208 at 1 / 2 / 3 rows: 6-12% more tensor-core work) and a short prologue a CTA.
// Measured (runs 147-149, H100, paired against the ReLU build): 0.91-0.92x the time at next_n = 4, 0.95x at 3 (with
// row groups), 0.99-1.00x at 2. Not the default, for exactness: where every head's dot product is <= 0 the ReLU sum is
// exactly 0 but the two halves here cancel, and the FP8 MMA's accumulator (truncating, so both halves' errors point
// the same way) leaves up to ~2x the 2^-13 bound there once queries or weights are widely spread (run 149: 6 of 8
// cases of test_matches_float64_over_wide_ranges fail with this build). SPIN_LOGITS_ABS_SUM=1 builds it (the probe's
// `abs` variant); the library builds the ReLU sum.
constexpr int TERMS = 4;

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbar_init(uint64_t* bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count));
}

__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
}

__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
}

__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
    uint32_t done;
    do {
        asm volatile(
            "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
            : "=r"(done) : "r"(smem_addr(bar)), "r"(parity) : "memory");
    } while (!done);
}

// rows [y, y + box rows) of a 2D tensor map into shared memory, completing `bytes` on bar
__device__ __forceinline__ void tma_load_2d(void* dst, const CUtensorMap* map, int x, int y, uint64_t* bar) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
        ::"r"(smem_addr(dst)), "l"(reinterpret_cast<uint64_t>(map)), "r"(x), "r"(y), "r"(smem_addr(bar)) : "memory");
}

// a plain bulk copy (no tensor map) of `bytes` (a multiple of 16, 16-aligned both sides)
__device__ __forceinline__ void bulk_load(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 ::"r"(smem_addr(dst)), "l"(src), "r"(bytes), "r"(smem_addr(bar)) : "memory");
}

// wgmma shared-memory descriptor of a K-major tile with the 128-byte swizzle: rows of 128 bytes, 8-row groups
// 1024 bytes apart (the stride byte offset); the leading byte offset is unused in this mode (1 by convention)
__device__ __forceinline__ uint64_t smem_desc(const void* p) {
    uint64_t addr = smem_addr(p);
    return ((addr & 0x3FFFF) >> 4) | (uint64_t(1) << 16) | (uint64_t(1024 >> 4) << 32) | (uint64_t(1) << 62);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int PENDING>  // waits until at most PENDING commit groups of this warpgroup are still running
__device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(PENDING) : "memory");
}

// wgmma_wait with a count known once loops are unrolled (0-3)
__device__ __forceinline__ void wgmma_wait_n(int pending) {
    if (pending <= 0) wgmma_wait<0>();
    else if (pending == 1) wgmma_wait<1>();
    else if (pending == 2) wgmma_wait<2>();
    else wgmma_wait<3>();
}

// keeps the compiler from moving accumulator reads / writes across the asynchronous MMA
template <int R>
__device__ __forceinline__ void fence_regs(float* d) {
#pragma unroll
    for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// max that returns NaN when either input is NaN (fmaxf returns the other): a block or group holding a NaN logit
// must keep a NaN maximum, which a pruning top-k never skips (ops.topk.group_max_ref); the same one FMNMX as fmaxf
__device__ __forceinline__ float max_nan(float a, float b) {
    float r;
    asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}

// an int from an int or a std::integral_constant (whose conversion operator is host-only for nvcc)
template <class V>
__device__ __forceinline__ constexpr int as_int(V v) {
    if constexpr (std::is_integral_v<V>) return v;
    else return V::value;
}

// The wgmma instructions, one per N. Inline PTX takes no operand lists, so each instruction's 32-128 accumulator
// operands are spelled out: SPIN_ACC32(o) is d[o .. o + 32) as read-write outputs, SPIN_REGS_k their "%n"
// references; SPIN_WGMMA(N, regs, desc_a, desc_b, accumulate operand numbers, accumulators...) defines
// wgmma_m64n<N>k32: D[64 x N] (+)= A[64 x 32] . B[N x 32]^T, fp8 e4m3 operands in shared memory (K-major, 128B
// swizzle), adding to D where `accumulate` is nonzero.
#define SPIN_ACC32(o) \
    "+f"(d[o + 0]), "+f"(d[o + 1]), "+f"(d[o + 2]), "+f"(d[o + 3]), "+f"(d[o + 4]), "+f"(d[o + 5]), \
    "+f"(d[o + 6]), "+f"(d[o + 7]), "+f"(d[o + 8]), "+f"(d[o + 9]), "+f"(d[o + 10]), "+f"(d[o + 11]), \
    "+f"(d[o + 12]), "+f"(d[o + 13]), "+f"(d[o + 14]), "+f"(d[o + 15]), "+f"(d[o + 16]), "+f"(d[o + 17]), \
    "+f"(d[o + 18]), "+f"(d[o + 19]), "+f"(d[o + 20]), "+f"(d[o + 21]), "+f"(d[o + 22]), "+f"(d[o + 23]), \
    "+f"(d[o + 24]), "+f"(d[o + 25]), "+f"(d[o + 26]), "+f"(d[o + 27]), "+f"(d[o + 28]), "+f"(d[o + 29]), \
    "+f"(d[o + 30]), "+f"(d[o + 31])
#define SPIN_REGS_0 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15" \
    ", %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define SPIN_REGS_1 ", %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47" \
    ", %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define SPIN_REGS_2 ", %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79" \
    ", %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95"
#define SPIN_REGS_3 ", %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111" \
    ", %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
#define SPIN_WGMMA(N, REGS, A, B, P, ...) \
    __device__ __forceinline__ void wgmma_m64n##N##k32(float* d, uint64_t desc_a, uint64_t desc_b, int accumulate) { \
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" #P ", 0;\n" \
                     "wgmma.mma_async.sync.aligned.m64n" #N "k32.f32.e4m3.e4m3 " \
                     "{" REGS "}, %" #A ", %" #B ", p, 1, 1;\n}\n" \
                     : __VA_ARGS__ \
                     : "l"(desc_a), "l"(desc_b), "r"(accumulate)); \
    }
// the |s| head sum's query tiles (AbsSum): 8 more columns a pair of rows
#define SPIN_ACC4(o) "+f"(d[o + 0]), "+f"(d[o + 1]), "+f"(d[o + 2]), "+f"(d[o + 3])
SPIN_WGMMA(64, SPIN_REGS_0, 32, 33, 34, SPIN_ACC32(0))
SPIN_WGMMA(72, SPIN_REGS_0 ", %32, %33, %34, %35", 36, 37, 38, SPIN_ACC32(0), SPIN_ACC4(32))
SPIN_WGMMA(128, SPIN_REGS_0 SPIN_REGS_1, 64, 65, 66, SPIN_ACC32(0), SPIN_ACC32(32))
SPIN_WGMMA(136, SPIN_REGS_0 SPIN_REGS_1 ", %64, %65, %66, %67", 68, 69, 70, SPIN_ACC32(0), SPIN_ACC32(32),
           SPIN_ACC4(64))
SPIN_WGMMA(192, SPIN_REGS_0 SPIN_REGS_1 SPIN_REGS_2, 96, 97, 98, SPIN_ACC32(0), SPIN_ACC32(32), SPIN_ACC32(64))
SPIN_WGMMA(208, SPIN_REGS_0 SPIN_REGS_1 SPIN_REGS_2 ", %96, %97, %98, %99, %100, %101, %102, %103", 104, 105, 106,
           SPIN_ACC32(0), SPIN_ACC32(32), SPIN_ACC32(64), SPIN_ACC4(96), SPIN_ACC4(100))
SPIN_WGMMA(256, SPIN_REGS_0 SPIN_REGS_1 SPIN_REGS_2 SPIN_REGS_3, 128, 129, 130, SPIN_ACC32(0), SPIN_ACC32(32),
           SPIN_ACC32(64), SPIN_ACC32(96))
#undef SPIN_WGMMA
#undef SPIN_ACC32
#undef SPIN_ACC4
#undef SPIN_REGS_0
#undef SPIN_REGS_1
#undef SPIN_REGS_2
#undef SPIN_REGS_3

template <int N>
__device__ __forceinline__ void mma_k32(float* d, uint64_t desc_a, uint64_t desc_b, int accumulate) {
    static_assert(N == 64 || N == 72 || N == 128 || N == 136 || N == 192 || N == 208 || N == 256, "an MMA width");
    if constexpr (N == 64) wgmma_m64n64k32(d, desc_a, desc_b, accumulate);
    else if constexpr (N == 72) wgmma_m64n72k32(d, desc_a, desc_b, accumulate);
    else if constexpr (N == 128) wgmma_m64n128k32(d, desc_a, desc_b, accumulate);
    else if constexpr (N == 136) wgmma_m64n136k32(d, desc_a, desc_b, accumulate);
    else if constexpr (N == 192) wgmma_m64n192k32(d, desc_a, desc_b, accumulate);
    else if constexpr (N == 208) wgmma_m64n208k32(d, desc_a, desc_b, accumulate);
    else wgmma_m64n256k32(d, desc_a, desc_b, accumulate);
}

constexpr int MAX_DEVICES = 64;  // device ordinals the launcher takes
constexpr int MAX_CHUNK = 256;  // blocks a CTA at most (their ids staged in shared memory; Shape::CHUNK_MAX)

// The CTA's shape at next_n rows: MATH_WG warpgroups; G of them share a block (row groups: group g computes the
// block's rows [g ROWS, (g + 1) ROWS), each with its own MMA of rows x 64 columns over the same key tile),
// so BP = MATH_WG / G blocks are in flight, block i taken by the warpgroups of block set i % BP. There is no
// producer warpgroup: one thread of each block set refills its STAGES_PER_WG stages (stage s always feeds block
// set s % BP) as soon as every warpgroup of the set is done with the stage. So every thread of the CTA is a math
// thread and the launch's even split of the registers is what they get (65536 / THREADS, rounded down to 8; no
// setmaxnreg): 512 threads 128 a thread, 256 threads 255. A producer warpgroup left the math ones 112 at next_n
// <= 2 (runs 104-105), where the loop spilled once unrolled.
// Default: four warpgroups on whole blocks at next_n 1-2 (up to 2 x 64 accumulators a thread); three at next_n = 3
// (96 accumulators in 168 registers, the weights in shared memory: SPIN_LOGITS_WEIGHTS_SMEM; 0.963x the time of two
// warpgroups with the weights in registers in runs 182 and 183, paired rounds, H100, 96 x 128K); four in two row
// groups at next_n = 4 (rows 0-1 and 2-3, 64 accumulators each; three on whole blocks 1.04-1.06x, runs 182-183).
// The AbsSum build (SPIN_LOGITS_ABS_SUM=1) puts next_n = 3 in two row groups too (rows 0-1 and 2; 4 more
// accumulators a row pair).
// With two warpgroups on whole blocks one warp an SMSP runs a block's epilogue while the other's MMA runs, and it
// issues an instruction only every ~3.5 cycles (ncu, run 113), so the tensor core idles half the time; row
// groups put four warps on each SMSP: 0.80x the time at next_n = 4, 0.99-1.05x at 3 (paired rounds, runs 115-116);
// groups of one row lose (run 120: next_n = 3 on three / six warpgroups 1.24x / 1.43x, next_n = 4 on four 1.19x).
// SPIN_LOGITS_CTAS_PER_SM = 2 splits an SM's warpgroups over two CTAs, each with half the shared memory (chunks of
// at most 128 / 64 blocks): measured slower (run 109: 538 against 490 us at 96 x 128K next_n = 2).
template <int NEXT_N>
struct Shape {
    static constexpr int CTAS = SPIN_LOGITS_CTAS_PER_SM;
    static_assert(CTAS == 1 || CTAS == 2, "one or two CTAs an SM");
    static constexpr int RG = NEXT_N == 3 ? SPIN_LOGITS_ROW_GROUPS_N3 : NEXT_N == 4 ? SPIN_LOGITS_ROW_GROUPS_N4 : 0;
    // row groups: 2 at next_n = 4, and at 3 in the AbsSum build (run 148, H100: 0.95x the ReLU build's time on whole
    // blocks; the AbsSum build on whole blocks 1.05x, N = 208 columns a warpgroup)
    static constexpr int G = NEXT_N < 3 ? 1 : RG > 0 ? RG : (NEXT_N == 4 || SPIN_LOGITS_ABS_SUM ? 2 : 1);
    static_assert(G >= 1 && G <= NEXT_N, "1 to next_n row groups");
    static constexpr int ROWS = (NEXT_N + G - 1) / G;  // rows of each row group (the last one: what is left)
    static_assert((G - 1) * ROWS < NEXT_N, "every row group has rows");
    // The |s| head sum (see AbsSum): a row group's query tile in shared memory is its rows' heads, then
    // XT = ceil(rows / 2) tiles of 8 columns holding each row's weighted query as TERMS FP8 terms (4 columns a row)
    static constexpr bool ABS = SPIN_LOGITS_ABS_SUM != 0;
    static constexpr int XT = ABS ? (ROWS + 1) / 2 : 0;
    static constexpr int QG = ROWS * H + 8 * XT;  // query rows of a row group (a multiple of 8: 1024-byte aligned)
    static constexpr int QROWS = G * QG;
    static_assert(ROWS * H + 8 * XT <= 256, "an MMA is at most 256 columns (next_n = 4 needs two row groups)");
    static constexpr int MW = NEXT_N == 3 ? SPIN_LOGITS_MATH_WG_N3 : NEXT_N == 4 ? SPIN_LOGITS_MATH_WG_N4
                                                                                 : SPIN_LOGITS_MATH_WG;
    // the default (see above): 4 at next_n 1-2 and in row groups of two rows (G = 2) or of one (G = 4 at next_n = 4);
    // 3 at next_n = 3 (whole blocks, or G = 3 groups of one row); 2 on whole blocks at next_n = 4 (probe builds)
    static constexpr int MW_DEFAULT = NEXT_N <= 2 || G == 2 || G == 4 ? 4 : NEXT_N == 3 ? 3 : 2;
    static constexpr int MATH_WG = (MW > 0 ? MW : MW_DEFAULT) / CTAS;
    static_assert(MATH_WG >= 1 && MATH_WG <= 8 && MATH_WG % G == 0, "1-8 math warpgroups, whole block sets");
    static constexpr int BP = MATH_WG / G;  // blocks in flight
    static constexpr bool WSMEM = SPIN_LOGITS_WEIGHTS_SMEM >= 0 ? SPIN_LOGITS_WEIGHTS_SMEM != 0
                                                                : NEXT_N >= 3 && G == 1 && BP * CTAS >= 3 && !ABS;
    static_assert(!(ABS && WSMEM), "AbsSum's prologue uses the weights' shared memory in its own layout");
    // WSMEM's layout: lane c's weights of row j are the 16 floats at c * WS_LANE + 16 j (heads 8k + 2c + e, in k then
    // e order); 4 floats of padding a lane put the four lanes' 16-byte loads on different banks
    static constexpr int WS_LANE = NEXT_N * 16 + 4;
    static constexpr int W_FLOATS = WSMEM ? 4 * WS_LANE : NEXT_N * H;  // the weights' shared memory (floats)
    static constexpr int THREADS = 128 * MATH_WG;
    // key blocks each block set keeps in flight (and the loop's unroll): 4 at next_n = 2 (0.97-0.98x the time of 3),
    // 2 at next_n = 4 (0.96x), 3 at next_n = 1 (paired rounds, run 122); at next_n = 3 4 with two block sets (0.986x),
    // 2 with three: the three warpgroups' unrolled loops are then ~34 KB of code an SMSP, not ~64 (w3 at 4 stages
    // stalled on instruction fetch, run 182), and 1 starved the copies (1.09x, run 183)
    static constexpr int SPW = SPIN_LOGITS_STAGES_PER_WG > 0 ? SPIN_LOGITS_STAGES_PER_WG
                             : NEXT_N == 3 ? (BP * CTAS >= 3 ? 2 : 4) : NEXT_N == 2 ? 4 : NEXT_N == 4 ? 2 : 3;
    static constexpr int STAGES = SPW * BP;
    static constexpr int smem_at(int chunk) {
        return 1024                                  // slack to align the tiles to 1024 bytes
               + QROWS * D                           // q [QROWS, 128]
               + NEXT_N * TERMS * 4                  // the terms' scales (AbsSum)
               + W_FLOATS * 4                        // the rows' weights (AbsSum's prologue, or WSMEM's)
               + STAGES * (KEY_BYTES + SCALE_BYTES)  // key tiles and their scales
               + chunk * NEXT_N * 32 * 4             // block-max partials [block][row][warp, quad]
               + chunk * 4                           // the chunk's block ids
               + (2 * STAGES + 1) * 8;               // mbarriers
    }
    // the most blocks a CTA takes: 256, halved until CTAS CTAs fit an SM's 227 KB (1 KB of each reserved)
    static constexpr int CHUNK_MAX = smem_at(256) * CTAS + (CTAS - 1) * 1024 <= 227 * 1024 ? 256
                                   : smem_at(128) * CTAS + (CTAS - 1) * 1024 <= 227 * 1024 ? 128 : 64;
    static constexpr int PMAX_FLOATS = CHUNK_MAX * NEXT_N * 32;
    static constexpr int SMEM = smem_at(CHUNK_MAX);
    static_assert(SMEM * CTAS + (CTAS - 1) * 1024 <= 227 * 1024, "shared memory");
};

// A quad's (4 lanes') head sums reduced and spread: v holds this lane's partial sums of value 2j + h (row j,
// token r0 + 8h), VP of them (2 * next_n rounded up to a power of two; next_n = 3 pads a zero row). Each step
// halves the values a lane keeps and adds its partner's half, so every partial crosses one shuffle (3 shuffles
// at next_n = 2 where a butterfly over all values takes 8). Lane c keeps value 2(c / 2) + (c % 2) at next_n = 2
// (row c / 2, token half c % 2) in v[0], rows c at next_n 3-4 (both halves, v[0] and v[1]), token half c / 2 at
// next_n = 1 (lanes c and c ^ 1 alike).
// one step: lanes with `bit` set keep v[HALF, 2 HALF), the others v[0, HALF), each summed with its partner's
template <int HALF, int VP>
__device__ __forceinline__ void keep_half(float (&v)[VP], int c, int bit) {
    const bool up = c & bit;
#pragma unroll
    for (int i = 0; i < HALF; ++i) {
        const float send = up ? v[i] : v[i + HALF], keep = up ? v[i + HALF] : v[i];
        v[i] = keep + __shfl_xor_sync(0xffffffffu, send, bit);
    }
}

template <int VP>
__device__ __forceinline__ void quad_reduce_scatter(float (&v)[VP], int c) {
    keep_half<VP / 2>(v, c, 2);
    if constexpr (VP >= 4) keep_half<VP / 4>(v, c, 1);
    else v[0] += __shfl_xor_sync(0xffffffffu, v[0], 1);  // next_n = 1: one value left, summed over both lanes
}

__device__ __forceinline__ float e4m3_to_float(uint8_t byte) {
    __nv_fp8_e4m3 v;
    v.__x = byte;
    return float(v);
}

// AbsSum's prologue (every thread of the CTA calls it): warp r < next_n turns row r's weighted query q_w[d] =
// sum_h w[r, h] q[r, h, d] (fp32, heads in order, 4 dimensions a lane, q read from the tile the TMA wrote) into
// TERMS e4m3 terms in its row group's extra query tile (rows 4 (j % 2) + t of tile j / 2 after the group's heads,
// j = r's index in the group; the partner's 4 rows zeroed where a group has an odd row count: a column no row uses
// must read 0, not NaN bytes) and their halved scales into sigma_s[r][t]. Returns once every thread can read them
// (the MMA's operands: generic-proxy stores, fenced for the async proxy).
template <int NEXT_N>
__device__ __forceinline__ void weighted_query_terms(const float* __restrict__ weights, int b, uint8_t* q_s,
                                                     float* sigma_s, float* w_s, uint64_t* q_bar) {
    using S = Shape<NEXT_N>;
    const int r = threadIdx.x / 32, lane = threadIdx.x % 32;  // warp r: row r
    if (r < NEXT_N) {
        const float* wrow = weights + (int64_t(b) * NEXT_N + r) * H;
        w_s[r * H + 2 * lane] = wrow[2 * lane];
        w_s[r * H + 2 * lane + 1] = wrow[2 * lane + 1];
        __syncwarp();
    }
    mbar_wait(q_bar, 0);
    if (r < NEXT_N) {
        const int g = r / S::ROWS, j = r % S::ROWS, rows = min(S::ROWS, NEXT_N - g * S::ROWS);
        // lane: dimensions 4 lane .. + 3, bytes 4 (lane % 4) of 16-byte chunk lane / 4 (swizzled by the row)
        const auto at = [&](int row) { return row * D + ((((lane >> 2) ^ (row & 7)) << 4) | ((lane & 3) << 2)); };
        float qw[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll 16
        for (int h = 0; h < H; ++h) {
            const uint32_t four = *reinterpret_cast<const uint32_t*>(q_s + at(g * S::QG + j * H + h));
            const float2 lo = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(four & 0xFFFF, __NV_E4M3)));
            const float2 hi = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(four >> 16, __NV_E4M3)));
            const float w = w_s[r * H + h];
            qw[0] = fmaf(w, lo.x, qw[0]);
            qw[1] = fmaf(w, lo.y, qw[1]);
            qw[2] = fmaf(w, hi.x, qw[2]);
            qw[3] = fmaf(w, hi.y, qw[3]);
        }
        const int first = g * S::QG + rows * H + (j / 2) * 8 + (j % 2) * TERMS;  // this row's first term row
#pragma unroll
        for (int t = 0; t < TERMS; ++t) {
            float m = fmaxf(fmaxf(fabsf(qw[0]), fabsf(qw[1])), fmaxf(fabsf(qw[2]), fabsf(qw[3])));
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
            // sigma = 2^(e - 8) puts the residual's max at [128, 256) (e4m3's largest is 448): the rounding keeps 4
            // significant bits of every element, and residual - e sigma is exact in fp32 (e sigma is within one
            // rounding of it); e clamped so that 1 / sigma stays finite for residuals below 2^-100
            int e;
            frexpf(m, &e);
            e = max(e, -100);
            const float inv = ldexpf(1.f, 8 - e), sigma = ldexpf(1.f, e - 8);
            uint32_t bytes = 0;
#pragma unroll
            for (int u = 0; u < 4; ++u) {
                const uint8_t byte = __nv_cvt_float_to_fp8(qw[u] * inv, __NV_SATFINITE, __NV_E4M3);
                qw[u] -= e4m3_to_float(byte) * sigma;
                bytes |= uint32_t(byte) << (8 * u);
            }
            *reinterpret_cast<uint32_t*>(q_s + at(first + t)) = bytes;
            if (j % 2 == 0 && j + 1 == rows) *reinterpret_cast<uint32_t*>(q_s + at(first + TERMS + t)) = 0u;
            if (lane == 0) sigma_s[r * TERMS + t] = 0.5f * sigma;
        }
    }
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    __syncthreads();
}

// grid (B, ceil(lead / chunk) + ceil((W - lead) / tail_chunk)), Shape::THREADS threads: the table's first `lead`
// columns in chunks of `chunk` blocks, the rest in chunks of `tail_chunk` (on SPIN's compact tables lead is the kept
// budget: the CTAs that have work fill the GPU, and those past it return at once unless a request keeps more, as
// on its first step, when every block is unscored; lead = W on a full table); the math warpgroups compute the
// chunk's blocks in turn, one thread of each block set issuing its copies. Block ids outside [0, num_cache_blocks)
// read block 0 (never outside the cache).
template <int NEXT_N, bool MAXIMA>
__global__ void __launch_bounds__(Shape<NEXT_N>::THREADS, Shape<NEXT_N>::CTAS) paged_logits_kernel(
        const __grid_constant__ CUtensorMap key_map, const __grid_constant__ CUtensorMap q_map,
        const uint8_t* __restrict__ cache, const float* __restrict__ weights, const int* __restrict__ seq_lens,
        const int* __restrict__ block_table, float* __restrict__ out, float* __restrict__ block_max,
        float* __restrict__ group_max, int stride_table, int64_t out_stride, int64_t bmax_stride, int64_t gmax_stride,
        int group, int chunk, int lead, int tail_chunk, int width, int num_cache_blocks, int rows_per_page,
        int64_t page_bytes) {
    using S = Shape<NEXT_N>;
    constexpr int G = S::G, BP = S::BP, STAGES = S::STAGES;
    // the tiles 1024-aligned, as the 128-byte swizzle needs (SMEM keeps 1024 bytes of slack for it); offsets
    // from the array itself keep the shared state space, so the compiler emits LDS / STS, not generic accesses
    extern __shared__ __align__(1024) uint8_t smem[];
    uint8_t* q_s = smem + ((1024 - (smem_addr(smem) & 1023)) & 1023);
    uint8_t* keys_s = q_s + S::QROWS * D;
    float* scales_s = reinterpret_cast<float*>(keys_s + STAGES * KEY_BYTES);
    float* pmax_s = scales_s + STAGES * T;
    int* ids_s = reinterpret_cast<int*>(pmax_s + S::PMAX_FLOATS);
    float* sigma_s = reinterpret_cast<float*>(ids_s + S::CHUNK_MAX);  // [NEXT_N][TERMS] halved term scales
    float* w_s = sigma_s + NEXT_N * TERMS;  // the rows' weights: [NEXT_N][64] (AbsSum), Shape::WS_LANE's (WSMEM)
    uint64_t* full = reinterpret_cast<uint64_t*>(w_s + S::W_FLOATS);
    uint64_t* empty = full + STAGES;
    uint64_t* q_bar = empty + STAGES;

    const int b = blockIdx.x;
    const int lead_chunks = (lead + chunk - 1) / chunk;
    const bool in_lead = int(blockIdx.y) < lead_chunks;
    const int blk0 = in_lead ? blockIdx.y * chunk : lead + (blockIdx.y - lead_chunks) * tail_chunk;
    const int end = in_lead ? min(blk0 + chunk, lead) : blk0 + tail_chunk;
    int longest = 0;
#pragma unroll
    for (int j = 0; j < NEXT_N; ++j) longest = max(longest, seq_lens[b * NEXT_N + j]);
    // blocks of this chunk below the longest row and inside the table (a length past W x T, possible with
    // validate=False, reads no id past the row and writes no logit past it)
    const int nblk = min(min(end, width), (longest + T - 1) / T) - blk0;
    if (nblk <= 0) return;  // the whole CTA: nothing to score, the tail is left unwritten
    // Compiled once per warpgroup (PER_WG, see `work` below) or once for all. In the second case the warpgroup
    // index is broadcast from lane 0, so the compiler knows it is warp-uniform and keeps the stage addresses and
    // descriptors derived from it in uniform registers (at next_n = 2: ~201 SASS instructions a block, not ~215)
    constexpr bool PER_WG = SPIN_LOGITS_PER_WG < 0 ? NEXT_N != 2 : SPIN_LOGITS_PER_WG == 1;
    const int mw = PER_WG || !SPIN_LOGITS_UNIFORM_WG ? int(threadIdx.x) / 128
                                                     : __shfl_sync(0xffffffffu, int(threadIdx.x) / 128, 0);
    const int tid = threadIdx.x % 128;
    const int set = mw / G;  // this warpgroup's block set: blocks set, set + BP, ... (row group mw % G of each)
    // the chunk's ids in shared memory first (coalesced): one dependent global load a block would serialize the
    // copies behind its latency
    const int* ids = block_table + int64_t(b) * stride_table + blk0;
    for (int i = threadIdx.x; i < nblk; i += S::THREADS) {
        const int raw = ids[i];
        ids_s[i] = (raw >= 0 && raw < num_cache_blocks) ? raw : 0;
    }
    if constexpr (S::WSMEM) {  // weight (row j, head h) where lane c = (h % 8) / 2 reads it: its 16 of row j in a row
        for (int t = threadIdx.x; t < NEXT_N * H; t += S::THREADS) {
            const int j = t / H, hd = t % H;
            w_s[(hd % 8) / 2 * S::WS_LANE + 16 * j + 2 * (hd / 8) + hd % 2] = weights[int64_t(b) * NEXT_N * H + t];
        }
    }
    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(&full[s], 1);
            mbar_init(&empty[s], 128 * G);  // every thread of the set, once its MMA has read the stage
        }
        mbar_init(q_bar, 1);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    // block i's copies into stage s (one thread)
    const auto load = [&](int i, int s) {
        const int phys = ids_s[i];
        mbar_expect_tx(&full[s], KEY_BYTES + SCALE_BYTES);
        tma_load_2d(keys_s + s * KEY_BYTES, &key_map, 0, phys * rows_per_page, &full[s]);
        bulk_load(scales_s + s * T, cache + int64_t(phys) * page_bytes + KEY_BYTES, SCALE_BYTES, &full[s]);
    };
    if (threadIdx.x == 0) {  // each row group's rows of q at the start of its query tile (boxes of ROWS x 64 rows)
        mbar_expect_tx(q_bar, G * S::ROWS * H * D);
#pragma unroll
        for (int g = 0; g < G; ++g) tma_load_2d(q_s + g * S::QG * D, &q_map, 0, (b * NEXT_N + g * S::ROWS) * H, q_bar);
    }
    // the thread that refills this set's stages: in row group 0, in warp mw % 4, so the sets' copies are issued
    // from different SMSPs (warp w runs on SMSP w % 4)
    const bool issuer = mw % G == 0 && tid == 32 * (mw % 4);
    // stage s, which held block i, is read (its MMA done, its scales loaded) by this thread: once every thread of the
    // set's row groups has arrived, the set's issuer refills it with block i + STAGES
    const auto release = [&](int i, int s, int phase) {
        mbar_arrive(&empty[s]);
        if (issuer && i + STAGES < nblk) {
            mbar_wait(&empty[s], phase);
            load(i + STAGES, s);
        }
    };
    constexpr int SPW = S::SPW;
    if (issuer)  // this set's first blocks
        for (int r = 0; r < SPW && set + r * BP < nblk; ++r) load(set + r * BP, set + r * BP);
    const int warp = tid / 32, lane = tid % 32;
    const int r0 = 16 * warp + lane / 4, c = lane % 4;  // this thread's tokens r0 and r0 + 8; its column pair
    if constexpr (S::ABS) weighted_query_terms<NEXT_N>(weights, b, q_s, sigma_s, w_s, q_bar);
    else mbar_wait(q_bar, 0);

    // The work of one warpgroup of row group GI: rows [ROW0, ROW0 + NR) of its set's blocks. Compiled once per
    // warpgroup (PER_WG: MW a constant, so every stage index, barrier, descriptor and scale address in the loop is
    // a constant offset from the shared window, the descriptors in uniform registers) or once per row group (MW at
    // run time). At next_n = 2 the four per-warpgroup copies, each unrolled by stages, stalled on instruction
    // fetch (26% of the samples, run 113) and one copy took 0.91x the time (paired rounds, run 115); at next_n = 3
    // one copy took 1.17x, at 4 1.00x.
    const auto work = [&](auto group_constant, auto mw_value) {
    constexpr int GI = decltype(group_constant)::value;
    constexpr int ROW0 = GI * S::ROWS;                                      // first row
    constexpr int NR = NEXT_N - ROW0 < S::ROWS ? NEXT_N - ROW0 : S::ROWS;  // rows
    constexpr int XT = S::ABS ? (NR + 1) / 2 : 0;                // AbsSum's term tiles
    constexpr int NG = NR * H + 8 * XT;                          // MMA columns
    constexpr int R = NG / 2;                                    // accumulators a thread
    constexpr int VP = 2 * NR <= 2 ? 2 : (2 * NR <= 4 ? 4 : 8);  // values a quad reduces (see quad_reduce_scatter)
    constexpr int KEPT = VP >= 8 ? 2 : 1;                        // values a lane keeps
    const int MW = as_int(mw_value);
    const int SET = MW / G;
    // w[row ROW0 + j, head 8k + 2c + e]: the heads of this thread's accumulator columns (WSMEM: none here, the
    // epilogue reads them from w_s)
    float wr[S::WSMEM ? 1 : NR][8][2];
    if constexpr (S::WSMEM) {
        (void)wr;
    } else {
        const float* wrow = weights + (int64_t(b) * NEXT_N + ROW0) * H;
#pragma unroll
        for (int j = 0; j < NR; ++j)
#pragma unroll
            for (int k = 0; k < 8; ++k)
#pragma unroll
                for (int e = 0; e < 2; ++e) wr[j][k][e] = (S::ABS ? 0.5f : 1.f) * wrow[j * H + 8 * k + 2 * c + e];
    }
    // AbsSum: the halved scales of the terms in this lane's columns of row j's term tile (tile j / 2: row j's terms
    // in columns 4 (j % 2) .. + 3; lane c holds columns 2c, 2c + 1), 0 where they are the other row's
    float ts[NR][2];
#pragma unroll
    for (int j = 0; j < NR; ++j)
#pragma unroll
        for (int u = 0; u < 2; ++u)
            ts[j][u] = S::ABS && (c >> 1) == (j & 1) ? sigma_s[(ROW0 + j) * TERMS + 2 * (c & 1) + u] : 0.f;
    // What this lane stores after the quad's reduce-scatter: value u of KEPT is row ROW0 + `row`, token half h[u];
    // the stores and the masks are set up once, a block only adds i * T
    const int row = VP >= 8 ? c : (VP == 4 ? c / 2 : 0);
    int h[KEPT];
    if constexpr (KEPT == 2) h[0] = 0, h[1] = 1;
    else h[0] = VP == 4 ? c % 2 : c / 2;
    const bool stores = VP == 2 ? c % 2 == 0 : row < NR;  // one row: lanes c, c ^ 1 alike; three: no row 3
    // the lane that writes its quad's block-max partial of its row: one a (quad, row)
    const bool pmax_writer = VP == 2 ? c == 0 : (VP == 4 ? c % 2 == 0 : row < NR);
    const int row_len = row < NR ? seq_lens[b * NEXT_N + ROW0 + row] : 0;
    // this lane's store addresses for block 0 of the chunk (block i adds i * T) and its token offsets below the
    // row's length (a value is a logit where i * T < lim, else -inf)
    float* dst[KEPT];
    int lim[KEPT];
#pragma unroll
    for (int u = 0; u < KEPT; ++u) {
        const int tok = r0 + 8 * h[u];
        dst[u] = out + (int64_t(b) * NEXT_N + ROW0 + min(row, NR - 1)) * out_stride + int64_t(blk0) * T + tok;
        lim[u] = row_len - blk0 * T - tok;
    }
    float acc[R];
#pragma unroll
    for (int i = 0; i < R; ++i) acc[i] = 0.f;
    // A block's last steps (the quad's reduce-scatter, the scale, the mask, the store and the block max: shuffle
    // chains, latency more than work). PIPELINED: they run while the next block's MMA does (`pending` holds the
    // head sums meanwhile): at next_n = 3 that measured 742 us against 804 (96 x 128K, run 107), at 4 in row
    // groups 0.96x (run 115); at next_n = 2 it lost (527 against 486: the compiler interleaves them with the MMA's
    // instructions). SPIN_LOGITS_PIPELINE overrides (0 / 1).
    constexpr bool PIPELINED = SPIN_LOGITS_PIPELINE < 0 ? NEXT_N >= 3 : SPIN_LOGITS_PIPELINE == 1;
    struct Pending {
        float v[VP];     // this thread's partial head sums (see quad_reduce_scatter)
        float sc[KEPT];  // the scales of the tokens this lane keeps
        int i;           // the block, in the chunk
    };
    const auto finish = [&](Pending& d) {
        if (SPIN_LOGITS_PROBE != 1) quad_reduce_scatter<VP>(d.v, c);
        float m = -INFINITY;
#pragma unroll
        for (int u = 0; u < KEPT; ++u) {
            const float x = d.i * T < lim[u] ? d.v[u] * d.sc[u] : -INFINITY;
            if (stores) dst[u][d.i * T] = x;
            m = max_nan(m, x);
        }
        if (!MAXIMA) return;
        // this row's max over the quad's 2 tokens (one or two rows: with the lane holding the other token half),
        // one partial a quad: the 32 partials of a (block, row) meet after the loop (no barrier, no shuffle chain
        // in it; 3 shuffles a block fewer than reducing over the warp here)
        if constexpr (VP == 4) m = max_nan(m, __shfl_xor_sync(0xffffffffu, m, 1));
        if constexpr (VP == 2) m = max_nan(m, __shfl_xor_sync(0xffffffffu, m, 2));
        if (pmax_writer) pmax_s[(d.i * NEXT_N + ROW0 + row) * 32 + warp * 8 + lane / 4] = m;
    };
    const uint64_t q_desc = smem_desc(q_s + GI * S::QG * D), k_desc_set = smem_desc(keys_s + SET * KEY_BYTES);
    Pending pending;
    pending.i = -1;  // none yet
    // ReLU (or |s| and the terms: AbsSum), weights and this thread's part of row j's head sums into pending.v[2 j],
    // pending.v[2 j + 1] (0 for the padding rows j >= NR): four independent FMA chains a row
    const auto head_sums = [&](int j) {
        if (j >= NR) {
            pending.v[2 * j] = pending.v[2 * j + 1] = 0.f;
        } else if (SPIN_LOGITS_PROBE == 1) {
            pending.v[2 * j] = acc[32 * j];
            pending.v[2 * j + 1] = acc[32 * j + 2];
        } else {
            float p[4] = {0.f, 0.f, 0.f, 0.f};
            if constexpr (S::ABS) {  // 1/2 q_w . k from the term tile, then 1/2 sum_h w_h |s_h|
                const int X = 4 * (8 * NR + j / 2);  // a constant once unrolled
#pragma unroll
                for (int e = 0; e < 4; ++e) p[e] = ts[j][e & 1] * acc[X + e];
#pragma unroll
                for (int k = 0; k < 8; ++k)
#pragma unroll
                    for (int e = 0; e < 4; ++e)
                        p[e] = fmaf(fabsf(acc[4 * (8 * j + k) + e]), wr[j][k][e & 1], p[e]);
            } else if constexpr (S::WSMEM) {
                const float4* wq = reinterpret_cast<const float4*>(w_s + c * S::WS_LANE + 16 * (ROW0 + j));
#pragma unroll
                for (int k2 = 0; k2 < 4; ++k2) {  // heads 8k + 2c + {0, 1} for k = 2 k2, 2 k2 + 1
                    const float4 w4 = wq[k2];
                    const float w[2][2] = {{w4.x, w4.y}, {w4.z, w4.w}};
#pragma unroll
                    for (int k1 = 0; k1 < 2; ++k1)
#pragma unroll
                        for (int e = 0; e < 4; ++e)
                            p[e] = fmaf(fmaxf(acc[4 * (8 * j + 2 * k2 + k1) + e], 0.f), w[k1][e & 1], p[e]);
                }
            } else {
#pragma unroll
                for (int k = 0; k < 8; ++k)
#pragma unroll
                    for (int e = 0; e < 4; ++e)
                        p[e] = fmaf(fmaxf(acc[4 * (8 * j + k) + e], 0.f), wr[j][k][e & 1], p[e]);
            }
            pending.v[2 * j] = p[0] + p[1];
            pending.v[2 * j + 1] = p[2] + p[3];
        }
    };
    // Row-pipelined (SPIN_LOGITS_ROW_PIPE): one MMA a row (N = 64 into acc[32 j, 32 j + 32), the same registers as
    // the one wide MMA's), each its own commit group, and the next block's row j issued once this block's row j is
    // summed, so rows j + 1.. of this block and rows ..j of the next are on the tensor core while row j's epilogue
    // runs (the default loop waits for the whole block's MMA before its epilogue). Groups retire in order, so
    // wait_group NR - 1 retires the row about to be read, NR - 1 - j in an iteration's last block (nothing issued
    // behind it). Measured slower than the default (run 184: 1.18-1.35x on two warpgroups); a probe build only.
    constexpr bool ROWPIPE = SPIN_LOGITS_ROW_PIPE != 0 && G == 1 && !S::ABS && NEXT_N >= 2 && SPIN_LOGITS_PROBE == 0;
    if constexpr (ROWPIPE) {
        const auto issue_row = [&](int j, int s) {  // row j of the block in stage s (the set's stage s - SET)
            fence_regs<32>(acc + 32 * j);
            wgmma_fence();
            const uint64_t k_desc = k_desc_set + uint64_t((s - SET) * (KEY_BYTES >> 4));
            const uint64_t q_row = q_desc + uint64_t(j * (H * D >> 4));
#pragma unroll
            for (int kk = 0; kk < D / 32; ++kk) mma_k32<64>(acc + 32 * j, k_desc + 2 * kk, q_row + 2 * kk, kk > 0);
            wgmma_commit();
        };
        // ptxas serializes every MMA where one is in flight across the loop's back edge (C7514), so the pipeline
        // runs inside an iteration's SPW blocks (unrolled) and drains at its end: each iteration's first block
        // issues its rows itself, the others were issued by the block before.
        for (int i0 = SET, phase = 0; i0 < nblk; i0 += SPW * BP, phase ^= 1) {
            mbar_wait(&full[SET], phase);
#pragma unroll
            for (int j = 0; j < NR; ++j) issue_row(j, SET);
#pragma unroll
            for (int rep = 0; rep < SPW; ++rep) {
                const int i = i0 + rep * BP;
                const int s = SET + rep * BP;
                if (i >= nblk) {  // past the set's last block (its rows ran on a stale stage, never read)
                    wgmma_wait<0>();
                    break;
                }
                const bool next = rep + 1 < SPW;  // a constant: the next block's rows are issued here
                const bool has_next = next && i + BP < nblk;
#pragma unroll
                for (int j = 0; j < VP / 2; ++j) {
                    if (j >= NR) {
                        head_sums(j);
                        continue;
                    }
                    // this block's row j: behind it rows j + 1.. of this block, and the next block's ..j - 1
                    wgmma_wait_n(next ? NR - 1 : NR - 1 - j);
                    fence_regs<32>(acc + 32 * j);
                    if (j == NR - 1) {  // every row's MMA has read the stage: its scales, then block i + STAGES
#pragma unroll
                        for (int u = 0; u < KEPT; ++u) pending.sc[u] = scales_s[s * T + r0 + 8 * h[u]];
                        release(i, s, phase);
                    }
                    head_sums(j);
                    if (j == 0 && has_next) mbar_wait(&full[s + BP], phase);
                    // the next block's row j, issued past the set's last block too (on a stage no copy is
                    // filling: the results are never read), as a branch around it would serialize the MMAs
                    if (next) issue_row(j, s + BP);
                }
                pending.i = i;
                finish(pending);  // beside the next block's first rows
            }
            wgmma_wait<0>();
        }
    } else {
        for (int i0 = SET, phase = 0; i0 < nblk; i0 += SPW * BP, phase ^= 1) {
#if SPIN_LOGITS_UNROLL
#pragma unroll
#else
#pragma unroll 1
#endif
            for (int rep = 0; rep < SPW; ++rep) {
                const int i = i0 + rep * BP;
                const int s = SET + rep * BP;  // a constant once unrolled, per warpgroup
                if (i >= nblk) break;
                mbar_wait(&full[s], phase);
                float sc[KEPT];
#pragma unroll
                for (int u = 0; u < KEPT; ++u) sc[u] = scales_s[s * T + r0 + 8 * h[u]];
                fence_regs<R>(acc);
                if (SPIN_LOGITS_PROBE != 2) {
                    wgmma_fence();
                    // k step kk: both descriptors + 32 bytes (2 in their 16-byte units)
                    const uint64_t k_desc = k_desc_set + uint64_t(rep * BP * (KEY_BYTES >> 4));
#pragma unroll
                    for (int kk = 0; kk < D / 32; ++kk) mma_k32<NG>(acc, k_desc + 2 * kk, q_desc + 2 * kk, kk > 0);
                    wgmma_commit();
                }
                if (PIPELINED && pending.i >= 0) finish(pending);  // the previous block, beside this one's MMA
                if (SPIN_LOGITS_PROBE != 2) wgmma_wait<0>();
                fence_regs<R>(acc);
                release(i, s, phase);  // this warpgroup's MMA has read the keys, its threads their scales
#pragma unroll
                for (int j = 0; j < VP / 2; ++j) head_sums(j);
#pragma unroll
                for (int u = 0; u < KEPT; ++u) pending.sc[u] = sc[u];
                pending.i = i;
                if (!PIPELINED) finish(pending);
            }
        }
        if (PIPELINED && pending.i >= 0) finish(pending);
    }
    if (!MAXIMA) return;
    asm volatile("bar.sync %0, 128;" ::"r"(1 + MW) : "memory");  // this warpgroup's partials written
    const int mine = (nblk - SET + BP - 1) / BP;  // blocks of this set
    for (int k = tid; k < mine * NR; k += 128) {
        const int i = SET + (k / NR) * BP, j = ROW0 + k % NR;
        // partial 8w + g covers tokens 16w + g and 16w + g + 8 (warp w's accumulator rows), so float4 q holds four
        // of warp q / 2's: 16-token group w is float4s 2w, 2w + 1, 32-token group g float4s 4g .. 4g + 3
        const float4* p = reinterpret_cast<const float4*>(pmax_s + (i * NEXT_N + j) * 32);
        float m16[4];
#pragma unroll
        for (int w = 0; w < 4; ++w) {
            const float4 x = p[2 * w], y = p[2 * w + 1];
            m16[w] = max_nan(max_nan(max_nan(x.x, x.y), max_nan(x.z, x.w)),
                             max_nan(max_nan(y.x, y.y), max_nan(y.z, y.w)));
        }
        const float m32[2] = {max_nan(m16[0], m16[1]), max_nan(m16[2], m16[3])};
        const int64_t out_row = int64_t(b) * NEXT_N + j;
        block_max[out_row * bmax_stride + blk0 + i] = max_nan(m32[0], m32[1]);
        if (group == 16) {
#pragma unroll
            for (int w = 0; w < 4; ++w) group_max[out_row * gmax_stride + 4 * (blk0 + i) + w] = m16[w];
        } else if (group == 32) {
#pragma unroll
            for (int g = 0; g < 2; ++g) group_max[out_row * gmax_stride + 2 * (blk0 + i) + g] = m32[g];
        }
    }
    };
    using std::integral_constant;
    if constexpr (PER_WG) {  // an if-chain: each branch instantiates only warpgroups that exist
        const auto per_wg = [&](auto mw_constant) {
            constexpr int M = decltype(mw_constant)::value;
            work(integral_constant<int, M % G>{}, mw_constant);
        };
        constexpr int P = S::MATH_WG;
        if (mw == 0) per_wg(integral_constant<int, 0>{});
        else if constexpr (P > 1) {
            if (mw == 1) per_wg(integral_constant<int, 1>{});
            else if constexpr (P > 2) {
                if (mw == 2) per_wg(integral_constant<int, 2>{});
                else if constexpr (P > 3) {
                    if (P == 4 || mw == 3) per_wg(integral_constant<int, 3>{});
                    else if constexpr (P > 4) {  // probe builds only (SPIN_LOGITS_MATH_WG_N3 / _N4 = 5-8)
                        if (mw == 4) per_wg(integral_constant<int, 4>{});
                        else if constexpr (P > 5) {
                            if (mw == 5) per_wg(integral_constant<int, 5>{});
                            else if constexpr (P > 6) {
                                if (mw == 6) per_wg(integral_constant<int, 6>{});
                                else if constexpr (P > 7) per_wg(integral_constant<int, 7>{});
                            }
                        }
                    }
                }
            }
        }
    } else {
        if (mw % G == 0) work(integral_constant<int, 0>{}, mw);
        else if constexpr (G > 1) {
            if (G == 2 || mw % G == 1) work(integral_constant<int, 1>{}, mw);
            else if constexpr (G > 2) {
                if (G == 3 || mw % G == 2) work(integral_constant<int, 2>{}, mw);
                else if constexpr (G > 3) work(integral_constant<int, 3>{}, mw);
            }
        }
    }
}

typedef CUresult (*EncodeTiled)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

EncodeTiled encode_fn() {  // the driver's cuTensorMapEncodeTiled, found at run time (no link to libcuda)
    static EncodeTiled fn = nullptr;
    if (fn == nullptr) {
        void* p = nullptr;
        cudaDriverEntryPointQueryResult status;
        if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &status) ==
                cudaSuccess && status == cudaDriverEntryPointSuccess)
            fn = reinterpret_cast<EncodeTiled>(p);
    }
    return fn;
}

// a [rows, 128] uint8 view of `base` read in boxes of box_rows rows with the 128-byte swizzle
int make_map(CUtensorMap* map, void* base, uint64_t rows, uint32_t box_rows) {
    EncodeTiled encode = encode_fn();
    if (encode == nullptr) return -1;
    cuuint64_t dims[2] = {uint64_t(D), rows};
    cuuint64_t strides[1] = {uint64_t(D)};
    cuuint32_t box[2] = {uint32_t(D), box_rows};
    cuuint32_t elem_strides[2] = {1, 1};
    return encode(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, base, dims, strides, box, elem_strides,
                  CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                  CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS ? 0 : -2;
}

template <int NEXT_N, bool MAXIMA>
int launch_kernel(const CUtensorMap& key_map, const CUtensorMap& q_map, const uint8_t* cache, const float* weights,
                  const int* seq_lens, const int* block_table, float* out, float* block_max, float* group_max,
                  int batch, int width, int stride_table, int64_t out_stride, int64_t bmax_stride,
                  int64_t gmax_stride, int group, int chunk, int lead, int tail_chunk, int num_cache_blocks,
                  int rows_per_page, int64_t page_bytes, int device, cudaStream_t stream) {
    constexpr int smem = Shape<NEXT_N>::SMEM;
    if (chunk > Shape<NEXT_N>::CHUNK_MAX || tail_chunk > Shape<NEXT_N>::CHUNK_MAX) return -5;
    static bool configured[MAX_DEVICES] = {};  // the attribute is per function and device: set once each
    if (!configured[device]) {
        const auto kernel = paged_logits_kernel<NEXT_N, MAXIMA>;
        if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) != cudaSuccess)
            return -3;
        configured[device] = true;
    }
    dim3 grid(batch, (lead + chunk - 1) / chunk + (width - lead + tail_chunk - 1) / tail_chunk);
    paged_logits_kernel<NEXT_N, MAXIMA><<<grid, Shape<NEXT_N>::THREADS, smem, stream>>>(
        key_map, q_map, cache, weights, seq_lens, block_table, out, block_max, group_max, stride_table, out_stride,
        bmax_stride, gmax_stride, group, chunk, lead, tail_chunk, width, num_cache_blocks, rows_per_page, page_bytes);
    return cudaGetLastError() == cudaSuccess ? 0 : -4;
}

template <int NEXT_N>
int launch(const CUtensorMap& key_map, void* q, const uint8_t* cache, const float* weights,
           const int* seq_lens, const int* block_table, float* out, float* block_max, float* group_max, int batch,
           int width, int stride_table, int64_t out_stride, int64_t bmax_stride, int64_t gmax_stride, int group,
           int chunk, int lead, int tail_chunk, int num_cache_blocks, int rows_per_page, int64_t page_bytes,
           int device, cudaStream_t stream) {
    CUtensorMap q_map;  // boxes of one row group's rows (Shape::ROWS x 64 rows of 128 bytes)
    if (int rc = make_map(&q_map, q, uint64_t(batch) * NEXT_N * H, uint32_t(Shape<NEXT_N>::ROWS * H))) return rc;
    const auto go = [&](auto kernel_launch) {
        return kernel_launch(key_map, q_map, cache, weights, seq_lens, block_table, out, block_max, group_max,
                             batch, width, stride_table, out_stride, bmax_stride, gmax_stride, group, chunk, lead,
                             tail_chunk, num_cache_blocks, rows_per_page, page_bytes, device, stream);
    };
    return block_max != nullptr ? go(launch_kernel<NEXT_N, true>) : go(launch_kernel<NEXT_N, false>);
}

}  // namespace

// Returns 0, or a negative code: -1 no cuTensorMapEncodeTiled, -2 a tensor map rejected, -3 the shared-memory
// attribute refused, -4 the launch failed, -5 bad arguments (the Python wrapper checks them first), -6 the
// device could not be made current.
extern "C" int spin_paged_logits_sm90(int next_n, void* q, void* cache, int64_t num_cache_blocks,
                                      int64_t page_bytes, const float* weights, const int* seq_lens,
                                      const int* block_table, int batch, int width, int stride_table, float* out,
                                      int64_t out_stride, float* block_max, int64_t bmax_stride, float* group_max,
                                      int64_t gmax_stride, int group, int chunk, int lead, int tail_chunk,
                                      int device, void* stream) {
    if (next_n < 1 || next_n > 4 || page_bytes % D != 0 || chunk < 1 || chunk > MAX_CHUNK) return -5;
    // the leading `lead` columns (1..W; W: a full table) chunked by `chunk`, the rest by `tail_chunk`
    if (lead < 1 || lead > width || tail_chunk < 1 || tail_chunk > MAX_CHUNK) return -5;
    // group maxima (16 or 32 columns) come from the block maxima's partials: only with them
    if (group_max != nullptr && (block_max == nullptr || (group != 16 && group != 32))) return -5;
    if (group_max == nullptr) group = 0;  // the kernel writes group maxima where group is 16 or 32
    if (device < 0 || device >= MAX_DEVICES) return -5;
    if (batch == 0 || width == 0) return 0;
    // This library carries its own CUDA runtime (nvcc links it statically), whose current device is not torch's:
    // the inputs' device is made current here, or a process on cuda:3 (an engine's tensor-parallel worker)
    // would launch on device 0 with a stream of device 3
    // (not called where it is current already: on one GPU this path is what runs 104-111 measured)
    int current = -1;
    if ((cudaGetDevice(&current) != cudaSuccess || current != device) && cudaSetDevice(device) != cudaSuccess)
        return -6;
    const int rows_per_page = int(page_bytes / D);
    CUtensorMap key_map;
    if (int rc = make_map(&key_map, cache, uint64_t(num_cache_blocks) * rows_per_page, T)) return rc;
    const uint8_t* c = static_cast<const uint8_t*>(cache);
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    switch (next_n) {
        case 1: return launch<1>(key_map, q, c, weights, seq_lens, block_table, out, block_max, group_max,
            batch, width, stride_table, out_stride, bmax_stride, gmax_stride, group, chunk, lead, tail_chunk,
            int(num_cache_blocks), rows_per_page, page_bytes, device, s);
        case 2: return launch<2>(key_map, q, c, weights, seq_lens, block_table, out, block_max, group_max,
            batch, width, stride_table, out_stride, bmax_stride, gmax_stride, group, chunk, lead, tail_chunk,
            int(num_cache_blocks), rows_per_page, page_bytes, device, s);
        case 3: return launch<3>(key_map, q, c, weights, seq_lens, block_table, out, block_max, group_max,
            batch, width, stride_table, out_stride, bmax_stride, gmax_stride, group, chunk, lead, tail_chunk,
            int(num_cache_blocks), rows_per_page, page_bytes, device, s);
        default: return launch<4>(key_map, q, c, weights, seq_lens, block_table, out, block_max, group_max,
            batch, width, stride_table, out_stride, bmax_stride, gmax_stride, group, chunk, lead, tail_chunk,
            int(num_cache_blocks), rows_per_page, page_bytes, device, s);
    }
}
