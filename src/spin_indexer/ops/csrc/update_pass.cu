// SPIN's EMA update of one query row from compact logits, in CUDA: the pass SpinIndexer runs beside the top-k
// (its side stream) where no other pass reads the logits (ops.update_history without maxima; history_cuda.py).
//
// Why CUDA and not Triton: the pass moves bytes and computes almost nothing (per kept token 4 B of logits read,
// 2 B of V read and 2 written), so its speed is the bytes it keeps in flight. The Triton pass (history_triton's
// _update_pass_kernel) stages its tiles through shared memory with cp.async and a barrier a tile, three programs
// of 4 warps an SM: Nsight Compute saw 17% achieved occupancy and DRAM at 57% (runs 78, 93). Here every
// half-warp takes whole blocks with plain vector loads (16 B of logits, 8 B of V a lane), four blocks loaded
// before any is updated, eight CTAs of 256 threads an SM: no shared memory, no barrier.
//
// Math (as history.update_history_ref for row j = `row` of every request): for compact block m < used (the
// blocks below the request's longest row) of request b whose row j updates (update_rows[b, j]) and which is a
// kept block (kept[b, m] >= 0), each column c = m * 64 + t below the row's compact length with a finite score s:
// V[p, t] <- ema(V[p, t], s) where p = table[b, m] (an id outside [0, trash) addresses the trash block), and
// where the position kept[b, m] * 64 + t lies in the row's diagonal window (offset q - pos in [0, window), q the
// row's query position) D[slot, offset] <- ema(D[slot, offset], s); a block that took a score gets its block max
// (the max of its 64 V cells after the update) and, where given, last_seen = *clock.
// ema(old, s) = s where old is not finite, else alpha * s + (1 - alpha) * old in float32 (two rounded products
// and a rounded sum, no FMA contraction: the reference's rounding), clamped into fp16's finite range, rounded
// to fp16. Cells not updated keep their bits; a block that took no score is not written at all.
// Shapes: T = 64 tokens a block; V fp16 [P + 1, 64] contiguous and 8-byte aligned; logits float32 rows 16-byte
// aligned (the Python wrapper checks both and otherwise keeps the Triton pass).

#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stddef.h>
#include <stdint.h>

// The kernel's arguments, one struct (history_cuda.UpdateArgs mirrors it field for field). Outside the
// anonymous namespace: a type of internal linkage in the entry point's signature would hide the entry point.
struct UpdateArgs {
    const float* logits;          // float32 [B, N, X]: row (b, j) at b * stride_b + j * stride_n
    int64_t logits_stride_b, logits_stride_n;
    const int32_t* table;         // int32 [B, >= M] physical ids of the compact blocks
    int64_t table_stride;
    const int32_t* compact_lens;  // int32 [B, N] contiguous
    __half* vertical;             // fp16 [P + 1, 64] contiguous (row P: the trash block)
    __half* block_max;            // fp16, entry p at p * block_max_stride
    int64_t block_max_stride;
    __half* diagonal;             // fp16 [S, DW + 1], row s at s * diagonal_stride
    int64_t diagonal_stride;
    int32_t* last_seen;           // int32, entry p at p * last_seen_stride; null: none kept
    int64_t last_seen_stride;
    const int32_t* clock;         // int32 [1]
    const int64_t* slot_ids;      // int64 [B]
    const int32_t* kept;          // int32 [B, >= M] logical ids of the compact blocks (< 0: not a kept block)
    int64_t kept_stride;
    const int32_t* seq_lens;      // int32 [B, N] contiguous: real row lengths
    const uint8_t* update_rows;   // bool [B, N] contiguous
    float alpha, beta;            // beta = 1 - alpha (rounded once, on the host, as the reference's)
    float lo, hi;                 // fp16's finite range
    int64_t window;               // DW
    int64_t trash;                // P
    int32_t next_n, num_blocks, row, programs;
};

namespace {

constexpr int kTokens = 64;                   // T: tokens a block
constexpr int kLanes = 16;                    // a half-warp takes a block, 4 tokens a lane
constexpr int kThreads = 256;
constexpr int kWorkers = kThreads / kLanes;  // blocks a CTA holds at once
constexpr int kUnroll = 4;                    // blocks a half-warp loads before it updates any

__device__ __forceinline__ float ema(float old, float obs, const UpdateArgs& a) {
    const float mixed = __fadd_rn(__fmul_rn(a.alpha, obs), __fmul_rn(a.beta, old));
    return fminf(fmaxf(isfinite(old) ? mixed : obs, a.lo), a.hi);
}

__device__ __forceinline__ float4 load_logits(const float* p, bool in) {
    const float inf = __int_as_float(0x7f800000);
    return in ? *reinterpret_cast<const float4*>(p) : make_float4(-inf, -inf, -inf, -inf);
}

// Program (b, p) = blockIdx.x: request b's compact blocks w, w + workers, ... for its half-warps w.
template <bool kHasSeen>
__global__ void __launch_bounds__(kThreads) update_pass_kernel(const UpdateArgs a) {
    const int b = blockIdx.x / a.programs;
    const int program = blockIdx.x - b * a.programs;
    const int64_t row = int64_t(b) * a.next_n + a.row;
    if (!a.update_rows[row]) return;  // a row that does not update (guarded) reads and writes no history
    int longest = 0;
    for (int r = 0; r < a.next_n; ++r) longest = max(longest, a.compact_lens[int64_t(b) * a.next_n + r]);
    const int used = min((longest + kTokens - 1) / kTokens, a.num_blocks);  // compact blocks the request uses
    const int clen = a.compact_lens[row];
    const int64_t q = int64_t(a.seq_lens[row]) - 1;
    const int64_t slot = a.slot_ids[b];
    const int32_t clock = kHasSeen ? *a.clock : 0;
    const int lane = threadIdx.x % kLanes;
    const bool upper = (threadIdx.x & 16) != 0;  // which half of its warp this lane is in
    const int worker = program * kWorkers + threadIdx.x / kLanes;
    const int workers = a.programs * kWorkers;
    const float* x_row = a.logits + int64_t(b) * a.logits_stride_b + int64_t(a.row) * a.logits_stride_n;
    const int32_t* table_row = a.table + int64_t(b) * a.table_stride;
    const int32_t* kept_row = a.kept + int64_t(b) * a.kept_stride;
    const float inf = __int_as_float(0x7f800000);
    // The loop runs alike in both halves of a warp (they start at the same even worker), so the ballots and
    // shuffles below see every lane; a half past `used` carries dead blocks.
    for (int first = worker & ~1; first < used; first += workers * kUnroll) {
        int m[kUnroll], kb[kUnroll], phys[kUnroll];  // phys < trash + 1 <= 2^31 (the wrapper checks)
        float4 x[kUnroll];
        uint2 old[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {  // ids and logits of every block first: one round trip for all
            m[u] = first + u * workers + (upper ? 1 : 0);
            const bool in = m[u] < used;
            const int id = in ? table_row[m[u]] : -1;
            kb[u] = in ? kept_row[m[u]] : -1;
            phys[u] = (id >= 0 && id < a.trash) ? id : int(a.trash);
            x[u] = load_logits(x_row + int64_t(m[u]) * kTokens + lane * 4, in && kb[u] >= 0);
        }
#pragma unroll
        for (int u = 0; u < kUnroll; ++u)  // then V (its address needs the id)
            old[u] = kb[u] >= 0 ? *reinterpret_cast<const uint2*>(a.vertical + int64_t(phys[u]) * kTokens + lane * 4)
                                : make_uint2(0, 0);
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
            const float obs_in[4] = {x[u].x, x[u].y, x[u].z, x[u].w};
            __half cell[4];
            *reinterpret_cast<uint2*>(cell) = old[u];
            float obs[4];
            bool live[4];
            bool any_local = false;
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int col = m[u] * kTokens + lane * 4 + i;
                obs[i] = col < clen ? obs_in[i] : -inf;
                live[i] = kb[u] >= 0 && isfinite(obs[i]);
                if (live[i]) cell[i] = __float2half_rn(ema(__half2float(cell[i]), obs[i], a));
                any_local |= live[i];
            }
            const unsigned ballot = __ballot_sync(0xffffffffu, any_local);
            const bool any = ((upper ? ballot >> 16 : ballot) & 0xffffu) != 0;  // the block took a score
            float vmax = fmaxf(fmaxf(__half2float(cell[0]), __half2float(cell[1])),
                               fmaxf(__half2float(cell[2]), __half2float(cell[3])));
#pragma unroll
            for (int off = kLanes / 2; off > 0; off /= 2) vmax = fmaxf(vmax, __shfl_xor_sync(0xffffffffu, vmax, off));
            if (!any) continue;
            __half* v_cells = a.vertical + int64_t(phys[u]) * kTokens + lane * 4;
            *reinterpret_cast<uint2*>(v_cells) = *reinterpret_cast<uint2*>(cell);
            if (lane == 0) {
                a.block_max[int64_t(phys[u]) * a.block_max_stride] = __float2half_rn(vmax);
                if (kHasSeen) a.last_seen[int64_t(phys[u]) * a.last_seen_stride] = clock;
            }
            // The diagonal window holds the row's last `window` positions: few blocks reach it
            const int64_t pos0 = int64_t(kb[u]) * kTokens;
            if (pos0 + kTokens - 1 <= q - a.window) continue;
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int64_t offset = q - (pos0 + lane * 4 + i);
                if (!live[i] || offset < 0 || offset >= a.window) continue;
                __half* d = a.diagonal + slot * a.diagonal_stride + offset;
                *d = __float2half_rn(ema(__half2float(*d), obs[i], a));
            }
        }
    }
}

}  // namespace

// UpdateArgs's layout for the Python mirror's test: field i's offset in bytes (declaration order), sizeof at -1,
// -1 past the last field.
extern "C" int64_t spin_update_args_layout(int field) {
    static const size_t offsets[] = {
        offsetof(UpdateArgs, logits), offsetof(UpdateArgs, logits_stride_b), offsetof(UpdateArgs, logits_stride_n),
        offsetof(UpdateArgs, table), offsetof(UpdateArgs, table_stride), offsetof(UpdateArgs, compact_lens),
        offsetof(UpdateArgs, vertical), offsetof(UpdateArgs, block_max), offsetof(UpdateArgs, block_max_stride),
        offsetof(UpdateArgs, diagonal), offsetof(UpdateArgs, diagonal_stride), offsetof(UpdateArgs, last_seen),
        offsetof(UpdateArgs, last_seen_stride), offsetof(UpdateArgs, clock), offsetof(UpdateArgs, slot_ids),
        offsetof(UpdateArgs, kept), offsetof(UpdateArgs, kept_stride), offsetof(UpdateArgs, seq_lens),
        offsetof(UpdateArgs, update_rows), offsetof(UpdateArgs, alpha), offsetof(UpdateArgs, beta),
        offsetof(UpdateArgs, lo), offsetof(UpdateArgs, hi), offsetof(UpdateArgs, window), offsetof(UpdateArgs, trash),
        offsetof(UpdateArgs, next_n), offsetof(UpdateArgs, num_blocks), offsetof(UpdateArgs, row),
        offsetof(UpdateArgs, programs)};
    const int count = int(sizeof(offsets) / sizeof(offsets[0]));
    if (field == -1) return int64_t(sizeof(UpdateArgs));
    return field >= 0 && field < count ? int64_t(offsets[field]) : -1;
}

// Launches the pass for row args->row of `batch` requests (args->programs CTAs a request) on `stream`. Returns 0,
// or -4 the launch failed, -5 bad arguments (the Python wrapper checks them first), -6 the device could not be
// made current.
extern "C" int spin_update_pass(const UpdateArgs* args, int batch, int device, void* stream) {
    if (args == nullptr || batch < 0 || args->programs < 1 || args->next_n < 1 || args->row < 0 ||
        args->row >= args->next_n || args->num_blocks < 0 || args->window < 0 || args->trash < 0 ||
        args->trash > 0x7ffffffe)
        return -5;
    if (batch == 0 || args->num_blocks == 0) return 0;
    if (int64_t(batch) * args->programs > 0x7fffffff) return -5;
    // This library carries its own CUDA runtime (nvcc links it statically), whose current device is not torch's
    // (as in paged_logits_sm90.cu): the inputs' device is made current here
    int current = -1;
    if ((cudaGetDevice(&current) != cudaSuccess || current != device) && cudaSetDevice(device) != cudaSuccess)
        return -6;
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    const unsigned grid = unsigned(batch) * unsigned(args->programs);
    if (args->last_seen != nullptr)
        update_pass_kernel<true><<<grid, kThreads, 0, s>>>(*args);
    else
        update_pass_kernel<false><<<grid, kThreads, 0, s>>>(*args);
    return cudaGetLastError() == cudaSuccess ? 0 : -4;
}
