"""The engine's C++ binding: DeepSpeed's CPU Adam kernel and the fused gradient accumulation.

One module, built once per machine from DeepSpeed's sources with DeepSpeed's own flags into
torch's extension cache (:func:`load_deepspeed_op`), its name carrying the hash of
:data:`_BINDING` and what the build depends on (``megatrain_ds/runtime/built_ops.py``), so a
changed binding builds afresh. What it exports:

- ``adam_step``: DeepSpeed's ``Adam_Optimizer::Step_8`` over a range in one OpenMP region,
  widening, scaling and the bf16 shadow fused in, with the GIL released
  (``cpu_adam.py``: [Note: the GIL and DeepSpeed's op], [Note: one pass over DeepSpeed's
  kernel]); ``create_adam``/``destroy_adam``: DeepSpeed's optimizer table.
- ``accumulate_grad``: a staged gradient chunk written or added into the held fp32
  gradients, with the sum of its squares (``gradient_accumulation.py``: [Note: the fused
  accumulation pass]).
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

from megatrain_ds.runtime.built_ops import build_directory, build_name, load_built, without_debug_info

logger = logging.getLogger(__name__)

# DeepSpeed's kernel source compiled into this module as one translation unit, so that its
# serial per-range routine (Adam_Optimizer::Step_8) can run on each thread's blocks
# ([Note: one pass over DeepSpeed's kernel]). Arguments are converted and checked with the
# GIL held; nothing after the release touches a Python object ([Note: the GIL and
# DeepSpeed's op]).
_BINDING = r"""
#include "cpu_adam_impl.cpp"

#include <omp.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <vector>

namespace {

// One per OpenMP thread; the pool's threads live as long as the process, so it is sized once.
thread_local std::vector<float> t_scratch;

// bf16 -> fp32 is exact (the bits, shifted); the product is torch's grad.float() * scale in
// fp32 (torch rounds a Python scale to fp32 too).
void widen_bf16(const uint16_t* grad, float scale, float* out, int64_t n)
{
    for (int64_t i = 0; i < n; ++i) {
        const uint32_t bits = static_cast<uint32_t>(grad[i]) << 16;
        float value;
        std::memcpy(&value, &bits, sizeof(value));
        out[i] = value * scale;
    }
}

void scale_fp32(const float* grad, float scale, float* out, int64_t n)
{
    for (int64_t i = 0; i < n; ++i) out[i] = grad[i] * scale;
}

// fp32 -> bf16 as torch's copy_ writes it: round to nearest even, every NaN -> 0xFFFF.
void round_to_bf16(const float* src, uint16_t* out, int64_t n)
{
    for (int64_t i = 0; i < n; ++i) {
        uint32_t bits;
        std::memcpy(&bits, &src[i], sizeof(bits));
        const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
        out[i] = (bits & 0x7FFFFFFFu) > 0x7F800000u ? uint16_t(0xFFFF) : static_cast<uint16_t>(rounded);
    }
}

// DeepSpeed's Step_8 does a range's last (length mod SIMD width) elements in a scalar loop
// that rounds m and v differently from its SIMD loop (by an ulp), so an element's update
// would depend on where the call's range ends: on how a step happens to be split into calls
// (gradient chunks as they arrive, speculation, threads), which varies from run to run on a
// GPU (tests/test_gpu.py's resume was an ulp off). Every element goes through the SIMD loop
// instead: a tail is stepped in a zero-padded buffer of one whole SIMD pass.
constexpr int64_t kSimdPass = 128;  // Step_8's unroll 8 x the SIMD width: 16 (AVX-512) or 8 (AVX2)

void step_every_element_vectorized(Adam_Optimizer& opt, float* p, float* g, float* m, float* v, int64_t n)
{
    const int64_t body = n / kSimdPass * kSimdPass;
    if (body > 0) opt.Step_8(p, g, m, v, static_cast<size_t>(body), false);
    const int64_t tail = n - body;
    if (tail == 0) return;
    alignas(64) float tp[kSimdPass] = {}, tg[kSimdPass] = {}, tm[kSimdPass] = {}, tv[kSimdPass] = {};
    const size_t bytes = static_cast<size_t>(tail) * sizeof(float);
    std::memcpy(tp, p + body, bytes);
    std::memcpy(tg, g + body, bytes);
    std::memcpy(tm, m + body, bytes);
    std::memcpy(tv, v + body, bytes);
    opt.Step_8(tp, tg, tm, tv, static_cast<size_t>(kSimdPass), false);  // zeros stay finite
    std::memcpy(p + body, tp, bytes);
    std::memcpy(m + body, tm, bytes);
    std::memcpy(v + body, tv, bytes);
}

void check_flat(const torch::Tensor& t, at::ScalarType dtype, int64_t numel, const char* name)
{
    TORCH_CHECK(t.device().is_cpu() && t.is_contiguous() && t.scalar_type() == dtype && t.numel() == numel,
                name, ": expected a contiguous CPU ", c10::toString(dtype), " tensor of ", numel, " elements");
}

void adam_step(int optimizer_id, int64_t step, float lr, float beta1, float beta2, float eps,
               float weight_decay, torch::Tensor params, torch::Tensor grads, torch::Tensor exp_avg,
               torch::Tensor exp_avg_sq, std::optional<torch::Tensor> shadow, float grad_scale,
               int64_t block, int64_t threads)
{
    const int64_t n = params.numel();
    check_flat(params, at::kFloat, n, "params");
    check_flat(exp_avg, at::kFloat, n, "exp_avg");
    check_flat(exp_avg_sq, at::kFloat, n, "exp_avg_sq");
    const bool bf16_grad = grads.scalar_type() == at::kBFloat16;
    check_flat(grads, bf16_grad ? at::kBFloat16 : at::kFloat, n, "grads");
    if (shadow) check_flat(*shadow, at::kBFloat16, n, "shadow");
    TORCH_CHECK(block > 0 && block % 128 == 0, "block must be a positive multiple of 128");
    TORCH_CHECK(threads > 0, "threads must be positive");
    auto found = s_optimizers.find(optimizer_id);
    TORCH_CHECK(found != s_optimizers.end(), "no Adam optimizer with id ", optimizer_id);
    auto opt = std::static_pointer_cast<Adam_Optimizer>(found->second);
    // The bias-correction powers from std::pow at every call: IncrementStep multiplies the
    // last ones by the betas when the step follows the op's last, which rounds differently,
    // so a resumed run (pow at its first step) would drift from the uninterrupted one. After
    // a call for step + 2 the op's last step is step + 2, whatever it was: the call for step
    // then takes the pow branch.
    opt->IncrementStep(step + 2, beta1, beta2);
    opt->IncrementStep(step, beta1, beta2);
    opt->update_state(lr, eps, weight_decay, true);

    float* p = params.data_ptr<float>();
    float* m = exp_avg.data_ptr<float>();
    float* v = exp_avg_sq.data_ptr<float>();
    float* g32 = bf16_grad ? nullptr : grads.data_ptr<float>();
    const uint16_t* g16 = bf16_grad ? static_cast<const uint16_t*>(grads.data_ptr()) : nullptr;
    uint16_t* out = shadow ? static_cast<uint16_t*>(shadow->data_ptr()) : nullptr;
    const bool direct = !bf16_grad && grad_scale == 1.0f;  // the kernel reads the gradient itself

    pybind11::gil_scoped_release no_gil;
    // The team size is the caller's: a thread that is not Python's main thread would
    // otherwise get OpenMP's process default (every CPU), not torch.set_num_threads'.
#pragma omp parallel num_threads(threads)
    {
        // One contiguous share per thread, as DeepSpeed's static split; shares and blocks start
        // on multiples of 128 (every SIMD width times the kernel's 8-way unroll).
        const int64_t threads = omp_get_num_threads(), thread = omp_get_thread_num();
        const int64_t share = ((n + threads - 1) / threads + 127) / 128 * 128;
        const int64_t begin = std::min(n, thread * share), end = std::min(n, begin + share);
        // Blocks only keep the scratch and the fresh master in cache between the steps.
        const int64_t step_numel = direct && !out ? std::max<int64_t>(end - begin, 1) : block;
        if (!direct && t_scratch.size() < static_cast<size_t>(block)) t_scratch.resize(block);
        for (int64_t start = begin; start < end; start += step_numel) {
            const int64_t len = std::min(step_numel, end - start);
            float* g = g32 + start;
            if (!direct) {
                if (bf16_grad) widen_bf16(g16 + start, grad_scale, t_scratch.data(), len);
                else scale_fp32(g32 + start, grad_scale, t_scratch.data(), len);
                g = t_scratch.data();
            }
            step_every_element_vectorized(*opt, p + start, g, m + start, v + start, len);
            if (out) round_to_bf16(p + start, out + start, len);
        }
    }
}

// -- accumulating a micro-batch's gradient chunk into the held fp32 gradients --------------
// (gradient_accumulation.py: [Note: the fused accumulation pass])

struct LoadFp32 {
    const float* src;
    float operator()(int64_t i) const { return src[i]; }
};
struct LoadBf16 {  // exact: the bits, shifted (torch's widening)
    const uint16_t* src;
    float operator()(int64_t i) const
    {
        const uint32_t bits = static_cast<uint32_t>(src[i]) << 16;
        float value;
        std::memcpy(&value, &bits, sizeof(value));
        return value;
    }
};
struct LoadFp16 {  // exact: torch's own conversion
    const uint16_t* src;
    float operator()(int64_t i) const { return c10::detail::fp16_ieee_to_fp32_value(src[i]); }
};

constexpr int64_t kSquaresBlock = 1 << 14;  // elements per fp64 partial sum of squares
constexpr int64_t kSquaresLanes = 16;       // independent fp64 sums per block: two AVX-512 vectors

// One block: held <- widen(x) * scale (kOverwrite) or held + widen(x) * scale, in fp32 (the
// product is exact for the power-of-two scales the caller allows, so a fused multiply-add
// rounds as torch's add_(x, alpha=scale) does); with kSquares the sum of the results'
// squares in fp64 (a square of an fp32 is exact in fp64): element i of the block goes to
// lane i mod 16, the lanes added in order, so the sum depends on the values alone.
template <bool kOverwrite, bool kSquares, typename Load>
double accumulate_block(float* held, Load load, float scale, int64_t begin, int64_t end)
{
    double lanes[kSquaresLanes] = {};
    int64_t i = begin;
    for (; i + kSquaresLanes <= end; i += kSquaresLanes) {
        for (int64_t lane = 0; lane < kSquaresLanes; ++lane) {
            const float x = load(i + lane) * scale;
            const float r = kOverwrite ? x : held[i + lane] + x;
            held[i + lane] = r;
            if (kSquares) lanes[lane] += static_cast<double>(r) * static_cast<double>(r);
        }
    }
    for (int64_t lane = 0; i < end; ++i, ++lane) {
        const float x = load(i) * scale;
        const float r = kOverwrite ? x : held[i] + x;
        held[i] = r;
        if (kSquares) lanes[lane] += static_cast<double>(r) * static_cast<double>(r);
    }
    double sum = 0.0;
    for (int64_t lane = 0; lane < kSquaresLanes; ++lane) sum += lanes[lane];
    return sum;
}

// The blocks in one OpenMP region of `threads` threads (static split); the partial sums
// added in block order after it: the same bits whatever the team size.
template <bool kOverwrite, bool kSquares, typename Load>
double accumulate_blocks(float* held, Load load, float scale, int64_t n, int64_t threads)
{
    const int64_t blocks = (n + kSquaresBlock - 1) / kSquaresBlock;
    std::vector<double> partials(kSquares ? blocks : 0);
#pragma omp parallel for schedule(static) num_threads(threads) if (blocks > 1 && threads > 1)
    for (int64_t block = 0; block < blocks; ++block) {
        const int64_t begin = block * kSquaresBlock, end = std::min(n, begin + kSquaresBlock);
        const double sum = accumulate_block<kOverwrite, kSquares>(held, load, scale, begin, end);
        if (kSquares) partials[block] = sum;
    }
    double total = 0.0;
    for (const double partial : partials) total += partial;
    return total;
}

template <typename Load>
double accumulate_as(float* held, Load load, float scale, int64_t n, bool overwrite, bool squares, int64_t threads)
{
    if (overwrite) {
        return squares ? accumulate_blocks<true, true>(held, load, scale, n, threads)
                       : accumulate_blocks<true, false>(held, load, scale, n, threads);
    }
    return squares ? accumulate_blocks<false, true>(held, load, scale, n, threads)
                   : accumulate_blocks<false, false>(held, load, scale, n, threads);
}

// held (fp32) <- [held +] widen(incoming) * scale, and the sum of the results' squares when
// `squares` (else 0): one pass, with the GIL released.
double accumulate_grad(torch::Tensor held, torch::Tensor incoming, double scale, bool overwrite, bool squares,
                       int64_t threads)
{
    const int64_t n = held.numel();
    check_flat(held, at::kFloat, n, "held");
    const at::ScalarType dtype = incoming.scalar_type();
    TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
                "incoming: expected fp32, bf16 or fp16, got ", c10::toString(dtype));
    check_flat(incoming, dtype, n, "incoming");
    TORCH_CHECK(threads > 0, "threads must be positive");
    float* out = held.data_ptr<float>();
    const void* src = incoming.data_ptr();
    const float factor = static_cast<float>(scale);

    pybind11::gil_scoped_release no_gil;
    if (dtype == at::kFloat)
        return accumulate_as(out, LoadFp32{static_cast<const float*>(src)}, factor, n, overwrite, squares, threads);
    if (dtype == at::kBFloat16)
        return accumulate_as(out, LoadBf16{static_cast<const uint16_t*>(src)}, factor, n, overwrite, squares, threads);
    return accumulate_as(out, LoadFp16{static_cast<const uint16_t*>(src)}, factor, n, overwrite, squares, threads);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m)
{
    m.def("adam_step", &adam_step, "DeepSpeed's CPU Adam on blocks, with widening, scaling and shadow");
    m.def("accumulate_grad", &accumulate_grad, "held fp32 gradients += widened chunk (* scale), and its squares' sum");
    m.def("create_adam", &create_adam_optimizer, "DeepSpeed CPU Adam create");
    m.def("destroy_adam", &destroy_adam_optimizer, "DeepSpeed CPU Adam destroy");
}
"""


@functools.lru_cache(maxsize=1)
def load_deepspeed_op() -> Any:
    """DeepSpeed's CPU Adam kernel with the binding above, built from DeepSpeed's sources with
    its own flags (``-O3 -march=native -fopenmp``, AVX2/AVX-512; no ``-g``); JIT-compiled on
    first use into torch's extension cache (25-110 s), imported from it after, in any
    virtualenv. Its
    name carries the binding's hash and what the build depends on
    (:func:`~megatrain_ds.runtime.built_ops.build_name`), so a new binding, DeepSpeed or torch
    builds afresh (and a cached build loads without recomputing DeepSpeed's flags, which
    probes the CPU for seconds)."""
    from torch.utils import cpp_extension

    name = build_name("cpu_adam", _BINDING)
    built = load_built(name)
    if built is not None:
        return built
    # The op builders are module attributes that op_builder/__init__.py sets in a loop.
    from deepspeed.ops.op_builder import CPUAdamBuilder  # pyright: ignore[reportAttributeAccessIssue]

    builder = CPUAdamBuilder()
    if not builder.is_compatible(verbose=False):
        raise RuntimeError(f"DeepSpeed's cpu_adam op cannot build here: {builder.error_log}")
    kernel_dirs = {
        os.path.dirname(os.path.abspath(builder.deepspeed_src_path(path)))
        for path in builder.sources()
        if path.endswith("_impl.cpp")
    }  # the binding includes cpu_adam_impl.cpp from there
    build_dir = build_directory(name)
    binding = build_dir / "binding.cpp"
    binding.write_text(_BINDING)
    logger.info("megatrain: building DeepSpeed's CPU Adam kernel (once, 25-110 s) in %s", build_dir)
    return cpp_extension.load(
        name=name,
        sources=[str(binding)],
        extra_include_paths=[
            *(os.path.abspath(builder.deepspeed_src_path(p)) for p in builder.include_paths()),
            *sorted(kernel_dirs),
        ],
        extra_cflags=[*without_debug_info(builder.strip_empty_entries(builder.cxx_args())), "-UC10_USE_GLOG"],
        extra_ldflags=builder.strip_empty_entries(builder.extra_ldflags()),
        build_directory=str(build_dir),
        verbose=False,
    )
