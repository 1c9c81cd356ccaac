// An XLA FFI handler that runs an ONNX Runtime session on XLA's own buffers: the offloaded
// region's crossing without jax.pure_callback (no Python, no copies, no GIL on the call path).
//
// ONNX Runtime's C API is reached through the library the `onnxruntime` wheel ships
// (libonnxruntime.so, loaded by the caller, which hands its `OrtGetApiBase` to JaxqOrtInit):
// `OrtGetApiBase()->GetApi(13)` returns its table of functions, a struct of
// function pointers whose slots never move between versions (ONNX Runtime checks that with
// static_asserts). Only the slots used here are named, by index, with their C signatures.
//
// Built on first use by jaxq/partition/_ort_ffi.py (g++, headers from jax.ffi.include_dir()).

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

struct OrtStatus;
struct OrtEnv;
struct OrtSession;
struct OrtSessionOptions;
struct OrtMemoryInfo;
struct OrtValue;

constexpr uint32_t kApiVersion = 13;  // every slot below exists from this version on

// Slots of OrtApi (index: signature).
using CreateEnvFn = OrtStatus* (*)(int level, const char* logid, OrtEnv** out);             // 3
using CreateSessionFromArrayFn = OrtStatus* (*)(const OrtEnv*, const void* data, size_t len,
                                                const OrtSessionOptions*, OrtSession** out);  // 8
using RunFn = OrtStatus* (*)(OrtSession*, const void* run_options, const char* const* in_names,
                             const OrtValue* const* inputs, size_t n_in,
                             const char* const* out_names, size_t n_out,
                             OrtValue** outputs);                                           // 9
using CreateSessionOptionsFn = OrtStatus* (*)(OrtSessionOptions** out);                      // 10
using SetIntFn = OrtStatus* (*)(OrtSessionOptions*, int);  // 22 log level, 23 opt level,
                                                           // 24 intra-op, 25 inter-op threads
using CreateTensorFn = OrtStatus* (*)(const OrtMemoryInfo*, void* data, size_t bytes,
                                      const int64_t* shape, size_t rank, int type,
                                      OrtValue** out);                                      // 49
using CreateCpuMemoryInfoFn = OrtStatus* (*)(int allocator, int mem_type,
                                             OrtMemoryInfo** out);                          // 69
using GetErrorMessageFn = const char* (*)(const OrtStatus*);                                 // 2
using ReleaseFn = void (*)(void*);  // 93 status, 96 value, 100 session options
using AddConfigEntryFn = OrtStatus* (*)(OrtSessionOptions*, const char*, const char*);      // 130

struct ApiBase {
  const void* const* (*GetApi)(uint32_t version);
  const char* (*GetVersionString)();
};

const void* const* api = nullptr;  // set once by JaxqOrtInit

const void* const* Api() { return api; }

template <typename F>
F Slot(int index) {
  return reinterpret_cast<F>(const_cast<void*>(Api()[index]));
}

// The message of a failed status (and the status released), or "" for success.
std::string Message(OrtStatus* status) {
  if (status == nullptr) return "";
  std::string msg = Slot<GetErrorMessageFn>(2)(status);
  Slot<ReleaseFn>(93)(status);
  return msg.empty() ? "ONNX Runtime failed" : msg;
}

OrtEnv* Env(std::string* error) {
  static std::mutex mu;
  static OrtEnv* env = nullptr;
  std::lock_guard<std::mutex> lock(mu);
  if (env == nullptr) *error = Message(Slot<CreateEnvFn>(3)(3, "jaxq", &env));
  return env;
}

const OrtMemoryInfo* CpuMemory(std::string* error) {
  static OrtMemoryInfo* info = nullptr;
  static std::once_flag once;
  std::call_once(once, [&] { *error = Message(Slot<CreateCpuMemoryInfoFn>(69)(0, 0, &info)); });
  return info;
}

struct Session {
  OrtSession* session = nullptr;
  std::string label;  // the region's name, for errors
  std::vector<std::string> in_names, out_names;
  std::vector<const char*> in_ptrs, out_ptrs;
  std::atomic<int64_t> calls{0};
};

// ONNX's element type for an XLA buffer's, or 0 where ONNX has none.
int OnnxType(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32: return 1;
    case ffi::DataType::U8: return 2;
    case ffi::DataType::S8: return 3;
    case ffi::DataType::U16: return 4;
    case ffi::DataType::S16: return 5;
    case ffi::DataType::S32: return 6;
    case ffi::DataType::S64: return 7;
    case ffi::DataType::PRED: return 9;
    case ffi::DataType::F16: return 10;
    case ffi::DataType::F64: return 11;
    case ffi::DataType::U32: return 12;
    case ffi::DataType::U64: return 13;
    case ffi::DataType::BF16: return 16;
    default: return 0;
  }
}

// An OrtValue over a buffer XLA owns (no copy).
std::string Wrap(const ffi::AnyBuffer& buf, OrtValue** out) {
  int type = OnnxType(buf.element_type());
  if (type == 0) return "an operand's dtype has no ONNX element type";
  std::string error;
  const OrtMemoryInfo* cpu = CpuMemory(&error);
  if (cpu == nullptr) return error;
  auto dims = buf.dimensions();
  std::vector<int64_t> shape(dims.begin(), dims.end());
  return Message(Slot<CreateTensorFn>(49)(cpu, buf.untyped_data(), buf.size_bytes(),
                                          shape.data(), shape.size(), type, out));
}

ffi::Error RunImpl(int64_t handle, ffi::RemainingArgs args, ffi::RemainingRets rets) {
  auto* s = reinterpret_cast<Session*>(handle);
  if (args.size() != s->in_ptrs.size() || rets.size() != s->out_ptrs.size()) {
    return ffi::Error::InvalidArgument("region " + s->label + ": operand count differs");
  }
  std::vector<OrtValue*> values(args.size() + rets.size(), nullptr);
  auto release = [&] {
    for (OrtValue* v : values) Slot<ReleaseFn>(96)(v);
  };
  std::string error;
  for (size_t i = 0; i < args.size() && error.empty(); ++i) {
    auto buf = args.get<ffi::AnyBuffer>(i);
    error = buf.has_value() ? Wrap(*buf, &values[i]) : "an operand is not a buffer";
  }
  for (size_t i = 0; i < rets.size() && error.empty(); ++i) {
    auto buf = rets.get<ffi::AnyBuffer>(i);
    error = buf.has_value() ? Wrap(**buf, &values[args.size() + i]) : "a result is not a buffer";
  }
  if (error.empty()) {
    error = Message(Slot<RunFn>(9)(s->session, nullptr, s->in_ptrs.data(), values.data(),
                                   args.size(), s->out_ptrs.data(), rets.size(),
                                   values.data() + args.size()));
  }
  release();
  if (!error.empty()) {
    return ffi::Error::Internal("region " + s->label + " failed on ONNX Runtime: " + error);
  }
  s->calls.fetch_add(1, std::memory_order_relaxed);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxqOrtRun, RunImpl,
                              ffi::Ffi::Bind()
                                  .Attr<int64_t>("handle")
                                  .RemainingArgs()
                                  .RemainingRets());

extern "C" {

// Takes ONNX Runtime's `OrtGetApiBase` (the library is loaded by the caller); false where the
// library has no C API version 13.
bool JaxqOrtInit(const ApiBase* (*get_api_base)()) {
  if (api == nullptr) api = get_api_base()->GetApi(kApiVersion);
  return api != nullptr;
}

// A session on `model` (serialized ONNX), or null with the reason in `error` (`error_len` bytes).
void* JaxqOrtOpen(const char* label, const void* model, size_t len, int intra_threads,
                  const char* const* in_names, size_t n_in, const char* const* out_names,
                  size_t n_out, char* error, size_t error_len) {
  std::string err;
  auto fail = [&](OrtSessionOptions* opts) -> void* {
    Slot<ReleaseFn>(100)(opts);
    std::snprintf(error, error_len, "%s", err.c_str());
    return nullptr;
  };
  if (Api() == nullptr) {
    err = "JaxqOrtInit was not called, or the library has no C API version 13";
    return fail(nullptr);
  }
  OrtEnv* env = Env(&err);
  if (env == nullptr) return fail(nullptr);
  OrtSessionOptions* opts = nullptr;
  if (!(err = Message(Slot<CreateSessionOptionsFn>(10)(&opts))).empty()) return fail(nullptr);
  // as the Python path: errors only, all graph optimizations, one thread per core, no spinning
  const std::pair<int, int> ints[] = {{22, 3}, {23, 99}, {24, intra_threads}, {25, 1}};
  for (auto [slot, value] : ints) {
    if (!(err = Message(Slot<SetIntFn>(slot)(opts, value))).empty()) return fail(opts);
  }
  for (const char* key : {"session.intra_op.allow_spinning", "session.inter_op.allow_spinning"}) {
    if (!(err = Message(Slot<AddConfigEntryFn>(130)(opts, key, "0"))).empty()) return fail(opts);
  }
  auto* s = new Session();
  err = Message(Slot<CreateSessionFromArrayFn>(8)(env, model, len, opts, &s->session));
  Slot<ReleaseFn>(100)(opts);
  if (!err.empty()) {
    delete s;
    return fail(nullptr);
  }
  s->label = label;
  s->in_names.assign(in_names, in_names + n_in);
  s->out_names.assign(out_names, out_names + n_out);
  for (auto& n : s->in_names) s->in_ptrs.push_back(n.c_str());
  for (auto& n : s->out_names) s->out_ptrs.push_back(n.c_str());
  return s;
}

int64_t JaxqOrtCalls(void* session) { return static_cast<Session*>(session)->calls.load(); }

}  // extern "C"
