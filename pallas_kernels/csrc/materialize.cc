// An identity XLA cannot fuse through, for the CPU path (pallas_kernels._cpu.materialized): its
// operand is computed once into a buffer that every consumer reads. XLA:CPU otherwise copies an
// elementwise producer into each consumer's fusion (and into each copy of a broadcast), so one
// value is recomputed several times per step. With the output aliased to the operand nothing moves.
#include <cstring>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

ffi::Error Materialize(ffi::AnyBuffer in, ffi::Result<ffi::AnyBuffer> out) {
  if (in.size_bytes() != out->size_bytes()) return ffi::Error::InvalidArgument("materialize: sizes differ");
  if (in.untyped_data() != out->untyped_data()) std::memcpy(out->untyped_data(), in.untyped_data(), in.size_bytes());
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(CedMaterialize, Materialize,
                              ffi::Ffi::Bind().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>());
