// CO2's consistency term: one chunk's dL/dz written over its logits, in place, on a CPU.
//
// The same math as trainer/classifier/consistency.py::_grad_logits (the reference, and the path on
// GPUs): see that module for the derivation.  Inductor fuses that function into one loop but cannot
// write its result over the logits, since each view's gradient reads the other views' logits; a
// separate result block costs a CPU rank a cache-cold write of the whole chunk (measured between the
// chunk matmuls, per 82k rows at B = 256: 25.7 ms for inductor's loop, 16.5 ms for this one, 11.3 ms
// for the plain loss's exp2).  Here each (row, rank, sample) group of views is loaded into registers,
// so its values can be overwritten.
//
// Layout: logits [rows, ranks, views, local] (the chunk's [rows, B]); shift, factor and own
// [ranks, views, local]; coefficients [3 (offset, slope, other), pairs, 2 (sides), ranks, local].
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>

namespace {

using Vec = at::vec::Vectorized<float>;

// A full vector, or the last `count` samples of a rank.
template <bool kFull>
Vec load(const float* source, int64_t count) {
  return kFull ? Vec::loadu(source) : Vec::loadu(source, count);
}

template <bool kFull>
void store(const Vec& value, float* target, int64_t count) {
  if (kFull) {
    value.store(target);
  } else {
    value.store(target, count);
  }
}

struct Layout {
  int64_t ranks, views, local, pairs;
  float ratio;  // exp(s) = exp2(ratio * z) when kPower is 0
};

// One rank's part of one row: where each tensor's values of its view 0 start, and the strides.
// Copied by value into the loop, so the compiler keeps it in registers across the stores.
struct RankSpan {
  float* logits;
  const float *shift, *factor, *own, *coefficients;  // coefficients: of pair 0, side 0, kind 0
  int64_t views, view_stride, side_stride, kind_stride;
  float ratio;
};

// Samples [sample, sample + count) of one rank's part of one row, every view.  The number of global
// views and the power are template parameters so that the per-view values live in registers (with
// runtime loops over arrays of vectors the compiler kept them on the stack: 2.2x slower).
template <int kGlobal, int kPower, bool kFull>
C10_ALWAYS_INLINE void grad_of_samples(const RankSpan span, const Vec& row, int64_t sample, int64_t count) {
  Vec logits[kGlobal], term[kGlobal], grad[kGlobal];
  const Vec zero(0.f);
  // Every exp2 first: each is a call that clobbers the vector registers, so values computed before it
  // are spilled to the stack and reloaded (interleaved, the loop took 20% longer).
  for (int view = 0; view < kGlobal; ++view) {
    const int64_t column = view * span.view_stride + sample;
    logits[view] = load<kFull>(span.logits + column, count);
    if constexpr (kPower > 0) {  // one exp2 serves both: exp2(z - shift) = exp2(z) * exp2(-shift)
      term[view] = logits[view].exp2();
    } else {
      grad[view] = (logits[view] - load<kFull>(span.shift + column, count)).exp2();
      term[view] = (logits[view] * Vec(span.ratio)).exp2();
    }
  }
  for (int view = 0; view < kGlobal; ++view) {
    const int64_t column = view * span.view_stride + sample;
    if constexpr (kPower > 0) {
      const Vec base = term[view];
      grad[view] = base * load<kFull>(span.factor + column, count);
      for (int k = 1; k < kPower; ++k) term[view] = term[view] * base;
    }
    term[view] = Vec::blendv(term[view], zero, row == load<kFull>(span.own + column, count));  // own row: no part
  }
  int pair = 0;
  for (int a = 0; a < kGlobal; ++a) {
    for (int b = a + 1; b < kGlobal; ++b, ++pair) {
      const Vec difference = logits[a] - logits[b];
      for (int side = 0; side < 2; ++side) {
        const int view = side == 0 ? a : b, other = side == 0 ? b : a;
        const float* c = span.coefficients + (pair * 2 + side) * span.side_stride + sample;
        const Vec offset = load<kFull>(c, count), slope = load<kFull>(c + span.kind_stride, count);
        const Vec other_factor = load<kFull>(c + 2 * span.kind_stride, count);
        grad[view] = grad[view] + term[view] * (offset + slope * difference) + term[other] * other_factor;
      }
    }
  }
  for (int view = 0; view < kGlobal; ++view) {
    store<kFull>(grad[view], span.logits + view * span.view_stride + sample, count);
  }
  for (int64_t view = kGlobal; view < span.views; ++view) {  // small crops: the kernel's part only
    const int64_t column = view * span.view_stride + sample;
    store<kFull>((load<kFull>(span.logits + column, count) - load<kFull>(span.shift + column, count)).exp2(),
                 span.logits + column, count);
  }
}

template <int kGlobal, int kPower>
void grad_of_rows(float* logits, int64_t rows, int64_t columns, const float* shift, const float* factor,
                  const float* own, const float* coefficients, const Layout& layout) {
  const int64_t local = layout.local, full = local - local % Vec::size();
  const int64_t side_stride = layout.ranks * local, kind_stride = layout.pairs * 2 * side_stride;
  const int64_t grain = std::max<int64_t>(1, 32768 / columns);  // rows per task when a rank runs threads
  at::parallel_for(0, rows, grain, [=](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const Vec position(static_cast<float>(row));
      for (int64_t rank = 0; rank < layout.ranks; ++rank) {
        const int64_t first = rank * layout.views * local;  // the rank's view 0
        const RankSpan span{logits + row * columns + first, shift + first, factor + first, own + first,
                            coefficients + rank * local, layout.views, local, side_stride, kind_stride,
                            layout.ratio};
        for (int64_t sample = 0; sample < full; sample += Vec::size()) {
          grad_of_samples<kGlobal, kPower, true>(span, position, sample, Vec::size());
        }
        if (full < local) {
          grad_of_samples<kGlobal, kPower, false>(span, position, full, local - full);
        }
      }
    }
  });
}

template <int kGlobal>
void dispatch_power(int64_t power, float* logits, int64_t rows, int64_t columns, const float* shift,
                    const float* factor, const float* own, const float* coefficients, const Layout& layout) {
  switch (power) {
    case 2: return grad_of_rows<kGlobal, 2>(logits, rows, columns, shift, factor, own, coefficients, layout);
    case 3: return grad_of_rows<kGlobal, 3>(logits, rows, columns, shift, factor, own, coefficients, layout);
    case 4: return grad_of_rows<kGlobal, 4>(logits, rows, columns, shift, factor, own, coefficients, layout);
    default: return grad_of_rows<kGlobal, 0>(logits, rows, columns, shift, factor, own, coefficients, layout);
  }
}

void check(const torch::Tensor& tensor, int64_t numel, const char* name) {
  TORCH_CHECK(tensor.device().is_cpu() && tensor.scalar_type() == torch::kFloat32 && tensor.is_contiguous(),
              name, " must be a contiguous fp32 CPU tensor");
  TORCH_CHECK(tensor.numel() == numel, name, " has ", tensor.numel(), " values, expected ", numel);
}

}  // namespace

// power: 2, 3 or 4 when exp(s) = exp(z) ** power, 0 otherwise (then ratio is used).
torch::Tensor consistency_grad_(torch::Tensor logits, torch::Tensor shift, torch::Tensor factor, torch::Tensor own,
                                torch::Tensor coefficients, int64_t ranks, int64_t views, int64_t global_views,
                                int64_t power, double ratio) {
  TORCH_CHECK(logits.dim() == 2 && 2 <= global_views && global_views <= 4 && global_views <= views,
              "logits must be [rows, B] with 2 <= global_views <= min(views, 4)");
  const int64_t rows = logits.size(0), columns = logits.size(1);
  TORCH_CHECK(columns % (ranks * views) == 0, "B = ", columns, " is not ranks x views x local");
  const Layout layout{ranks, views, columns / (ranks * views), global_views * (global_views - 1) / 2,
                      static_cast<float>(ratio)};
  check(logits, rows * columns, "logits");
  check(shift, columns, "shift");
  check(factor, columns, "factor");
  check(own, columns, "own");
  check(coefficients, 3 * layout.pairs * 2 * ranks * layout.local, "coefficients");
  float* data = logits.data_ptr<float>();
  const float *shift_data = shift.data_ptr<float>(), *factor_data = factor.data_ptr<float>();
  const float *own_data = own.data_ptr<float>(), *coefficient_data = coefficients.data_ptr<float>();
  switch (global_views) {
    case 2: dispatch_power<2>(power, data, rows, columns, shift_data, factor_data, own_data, coefficient_data, layout); break;
    case 3: dispatch_power<3>(power, data, rows, columns, shift_data, factor_data, own_data, coefficient_data, layout); break;
    default: dispatch_power<4>(power, data, rows, columns, shift_data, factor_data, own_data, coefficient_data, layout);
  }
  return logits;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.def("consistency_grad_", &consistency_grad_, "CO2 term: a chunk's dL/dz over its logits, in place");
}
