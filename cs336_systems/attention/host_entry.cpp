// The C++ host entry of FlashAttentionTriton: an eager forward + backward whose launch plans are known runs
// without Python between the caller and the GPU. See host_entry.py for why and for what records the plans.
//
// A plan is exported from Python (launch_plan.LaunchPlan) once per call signature: per launch, the CUfunction,
// grid, block and shared memory, and the kernel parameters as one byte template laid out as Triton 3.6's C
// launcher lays them out, with holes where the call's tensor addresses and TMA maps go. A call here computes the
// signature key from its tensors, allocates the outputs as the Python path does, fills the holes and launches
// with cuLaunchKernelEx (reached through dlsym on libcuda, as Triton's launcher does). A key without a plan
// returns None (forward) or calls back into Python (backward), which records and exports one.

#include <torch/extension.h>
#include <torch/csrc/autograd/custom_function.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cuda.h>
#include <dlfcn.h>

#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

namespace py = pybind11;

namespace {

// ------------------------------------------------------------------------------------------------
// The driver entry points, looked up by name as Triton's launcher and its descriptor encoder do.
// ------------------------------------------------------------------------------------------------

using LaunchKernelEx = CUresult (*)(const CUlaunchConfig*, CUfunction, void**, void**);
using EncodeTiled = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                 const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                 CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
using ErrorString = CUresult (*)(CUresult, const char**);
using CtxGetCurrent = CUresult (*)(CUcontext*);
using DeviceGet = CUresult (*)(CUdevice*, int);
using PrimaryCtxRetain = CUresult (*)(CUcontext*, CUdevice);
using CtxSetCurrent = CUresult (*)(CUcontext);

struct Driver {
  LaunchKernelEx launch = nullptr;
  EncodeTiled encode = nullptr;
  ErrorString error = nullptr;
  CtxGetCurrent ctx_get = nullptr;
  DeviceGet device_get = nullptr;
  PrimaryCtxRetain primary_retain = nullptr;
  CtxSetCurrent ctx_set = nullptr;
};

const Driver& driver() {
  static const Driver d = [] {
    void* lib = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_LOCAL);
    if (lib == nullptr) throw std::runtime_error("host entry: cannot open libcuda.so.1");
    Driver out;
    out.launch = reinterpret_cast<LaunchKernelEx>(dlsym(lib, "cuLaunchKernelEx"));
    out.encode = reinterpret_cast<EncodeTiled>(dlsym(lib, "cuTensorMapEncodeTiled"));
    out.error = reinterpret_cast<ErrorString>(dlsym(lib, "cuGetErrorString"));
    out.ctx_get = reinterpret_cast<CtxGetCurrent>(dlsym(lib, "cuCtxGetCurrent"));
    out.device_get = reinterpret_cast<DeviceGet>(dlsym(lib, "cuDeviceGet"));
    out.primary_retain = reinterpret_cast<PrimaryCtxRetain>(dlsym(lib, "cuDevicePrimaryCtxRetain"));
    out.ctx_set = reinterpret_cast<CtxSetCurrent>(dlsym(lib, "cuCtxSetCurrent"));
    if (!out.launch || !out.encode || !out.error || !out.ctx_get || !out.device_get || !out.primary_retain ||
        !out.ctx_set)
      throw std::runtime_error("host entry: libcuda.so.1 lacks an entry point it needs (cuLaunchKernelEx, ...)");
    return out;
  }();
  return d;
}

void check(CUresult code, const char* what) {
  if (code == CUDA_SUCCESS) return;
  const char* text = nullptr;
  driver().error(code, &text);
  throw std::runtime_error(std::string("host entry: ") + what + " failed: " + (text ? text : "unknown error"));
}

// ------------------------------------------------------------------------------------------------
// Plans
// ------------------------------------------------------------------------------------------------

//: TMA maps remembered per hole, by base address (the caching allocator hands out the same few).
constexpr size_t kMapsPerHole = 64;

struct PointerHole {
  size_t offset;
  int tensor;
};

struct MapHole {
  size_t offset;
  int tensor;
  CUtensorMapDataType dtype;
  cuuint32_t rank;
  cuuint64_t dims[5];     // innermost first, as the encoder takes them
  cuuint64_t strides[5];  // bytes, rank - 1 of them, innermost first
  cuuint32_t box[5];
  CUtensorMapSwizzle swizzle;
  CUtensorMapFloatOOBfill fill;
  std::unordered_map<uint64_t, CUtensorMap> maps;
};

struct Launch {
  CUfunction function = nullptr;
  unsigned grid[3] = {1, 1, 1};
  unsigned block = 0;
  unsigned shared = 0;
  bool cooperative = false;
  bool pdl = false;
  std::unique_ptr<uint8_t, decltype(&std::free)> bytes{nullptr, &std::free};
  std::vector<void*> params;  // into bytes, one per kernel parameter
  std::vector<PointerHole> pointers;
  std::vector<MapHole> maps;

  void fill(const std::vector<at::Tensor>& tensors) {
    for (const auto& hole : pointers) {
      const uint64_t address = reinterpret_cast<uint64_t>(tensors[hole.tensor].data_ptr());
      std::memcpy(bytes.get() + hole.offset, &address, sizeof(address));
    }
  }

  void run(const std::vector<at::Tensor>& tensors, CUstream stream) {
    fill(tensors);
    for (auto& hole : maps) {
      const uint64_t address = reinterpret_cast<uint64_t>(tensors[hole.tensor].data_ptr());
      auto found = hole.maps.find(address);
      if (found == hole.maps.end()) {
        if (hole.maps.size() >= kMapsPerHole) hole.maps.clear();
        CUtensorMap map;
        const cuuint32_t unit[5] = {1, 1, 1, 1, 1};
        check(driver().encode(&map, hole.dtype, hole.rank, reinterpret_cast<void*>(address), hole.dims,
                              hole.strides, hole.box, unit, CU_TENSOR_MAP_INTERLEAVE_NONE, hole.swizzle,
                              CU_TENSOR_MAP_L2_PROMOTION_L2_128B, hole.fill),
              "cuTensorMapEncodeTiled");
        found = hole.maps.emplace(address, map).first;
      }
      std::memcpy(bytes.get() + hole.offset, &found->second, sizeof(CUtensorMap));
    }
    if (grid[0] * grid[1] * grid[2] == 0) return;
    CUlaunchAttribute attributes[2];
    unsigned n_attributes = 0;
    if (pdl) {
      attributes[n_attributes].id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
      attributes[n_attributes++].value.programmaticStreamSerializationAllowed = 1;
    }
    if (cooperative) {
      attributes[n_attributes].id = CU_LAUNCH_ATTRIBUTE_COOPERATIVE;
      attributes[n_attributes++].value.cooperative = 1;
    }
    CUlaunchConfig config{};
    config.gridDimX = grid[0];
    config.gridDimY = grid[1];
    config.gridDimZ = grid[2];
    config.blockDimX = block;
    config.blockDimY = 1;
    config.blockDimZ = 1;
    config.sharedMemBytes = shared;
    config.hStream = stream;
    config.attrs = attributes;
    config.numAttrs = n_attributes;
    check(driver().launch(&config, function, params.data(), nullptr), "cuLaunchKernelEx");
  }
};

struct Plan {
  std::vector<Launch> launches;
  int64_t dq_rows = -1;  // backward: rows per head of the float32 dQ sums, or -1 where none are allocated
};

using Key = std::vector<int64_t>;

struct KeyHash {
  size_t operator()(const Key& key) const {
    size_t h = 0xcbf29ce484222325ull;
    for (int64_t x : key) h = (h ^ static_cast<size_t>(x)) * 0x100000001b3ull;
    return h;
  }
};

//: Plans by key (a null plan: this signature never replays here, the backward calls Python every time).
constexpr size_t kMaxPlans = 512;
std::mutex plans_mutex;
std::unordered_map<Key, std::shared_ptr<Plan>, KeyHash> plans;
std::atomic<int64_t> replays{0};
// Python's backward for keys without a plan here (set by flash_triton.py). Never destroyed: a static py::object
// would be released after the interpreter has shut down.
py::object* backward_miss = new py::object();

enum Kind : int64_t { kForward = 0, kBackward = 1 };

void push_layout(Key& key, const at::Tensor& t, bool sizes) {
  key.push_back(t.dim());
  if (sizes)
    for (int64_t s : t.sizes()) key.push_back(s);
  for (int64_t s : t.strides()) key.push_back(s);
}

int64_t aligned_bits(std::initializer_list<const at::Tensor*> tensors) {
  int64_t bits = 0, i = 0;
  for (const at::Tensor* t : tensors) bits |= int64_t(reinterpret_cast<uintptr_t>(t->data_ptr()) % 16 == 0) << i++;
  return bits;
}

// What the Python path's plan key holds for these tensors: shapes, strides, dtypes, device, mask, the options'
// generation and which addresses are 16-byte aligned. Outputs are fresh allocations, always aligned.
Key forward_key(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal, int64_t generation) {
  Key key{kForward};
  push_layout(key, q, true);
  push_layout(key, k, true);
  push_layout(key, v, true);
  key.insert(key.end(), {int64_t(q.scalar_type()), int64_t(k.scalar_type()), int64_t(v.scalar_type()),
                         q.device().index(), causal, generation, aligned_bits({&q, &k, &v})});
  return key;
}

Key backward_key(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                 const at::Tensor& o, const at::Tensor& lse, bool causal, int64_t generation) {
  Key key{kBackward};
  push_layout(key, q, true);
  push_layout(key, k, true);
  push_layout(key, v, true);
  push_layout(key, o, true);
  push_layout(key, lse, true);
  push_layout(key, dout, true);
  key.insert(key.end(), {int64_t(q.scalar_type()), int64_t(k.scalar_type()), int64_t(v.scalar_type()),
                         int64_t(o.scalar_type()), int64_t(lse.scalar_type()), int64_t(dout.scalar_type()),
                         q.device().index(), causal,
                         generation, aligned_bits({&dout, &q, &k, &v, &o, &lse})});
  return key;
}

std::shared_ptr<Plan> find(const Key& key, bool* known) {
  std::lock_guard<std::mutex> lock(plans_mutex);
  auto found = plans.find(key);
  *known = found != plans.end();
  return *known ? found->second : nullptr;
}

// Launches hold per-hole map caches and write their holes in place: one call at a time.
std::mutex launch_mutex;

// A thread whose first CUDA work is a replay may have no current context (the guard sets the device only where
// it differs); the driver API needs one, so the device's primary context is made current, as Triton's launcher does.
void ensure_context(int device) {
  CUcontext context = nullptr;
  check(driver().ctx_get(&context), "cuCtxGetCurrent");
  if (context != nullptr) return;
  CUdevice handle;
  check(driver().device_get(&handle, device), "cuDeviceGet");
  check(driver().primary_retain(&context, handle), "cuDevicePrimaryCtxRetain");
  check(driver().ctx_set(context), "cuCtxSetCurrent");
}

void run(Plan& plan, const std::vector<at::Tensor>& tensors, const at::Tensor& first) {
  const c10::cuda::CUDAGuard guard(first.device());
  ensure_context(first.device().index());
  const CUstream stream = c10::cuda::getCurrentCUDAStream(first.device().index()).stream();
  std::lock_guard<std::mutex> lock(launch_mutex);
  for (auto& launch : plan.launches) launch.run(tensors, stream);
  replays.fetch_add(1, std::memory_order_relaxed);
}

// Python's "make the head dim contiguous" rule (flash_triton._unit_stride_d) for the incoming gradient.
at::Tensor unit_stride_d(const at::Tensor& t) {
  bool zero = false;
  for (int64_t s : t.strides()) zero |= s == 0;
  return (t.stride(-1) == 1 && !zero) ? t : t.contiguous();
}

// [L; D] row pairs: float32 (batch * heads, 2, n) with rows padded to 16 bytes (flash_triton._row_buffer).
at::Tensor row_buffer(int64_t rows, int64_t n, const at::TensorOptions& options) {
  const int64_t padded = (n + 3) / 4 * 4;
  at::Tensor buffer = at::empty({rows, 2, padded}, options.dtype(at::kFloat));
  return padded == n ? buffer : buffer.narrow(2, 0, n);
}

// ------------------------------------------------------------------------------------------------
// The autograd function
// ------------------------------------------------------------------------------------------------

struct FlashAttention : public torch::autograd::Function<FlashAttention> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                            const at::Tensor& v, bool causal, int64_t generation, std::shared_ptr<Plan> plan) {
    at::Tensor o = at::empty_like(q);
    at::Tensor lse = at::empty({q.size(0), q.size(1), q.size(2)}, q.options().dtype(at::kFloat));
    run(*plan, {q, k, v, o, lse}, q);
    ctx->save_for_backward({q, k, v, o, lse});
    ctx->saved_data["causal"] = causal;
    ctx->saved_data["generation"] = generation;  // a backward runs under its forward's options
    return o;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &q = saved[0], &k = saved[1], &v = saved[2], &o = saved[3], &lse = saved[4];
    const bool causal = ctx->saved_data["causal"].toBool();
    const int64_t generation = ctx->saved_data["generation"].toInt();
    const at::Tensor dout = unit_stride_d(grads[0]);
    bool known = false;
    std::shared_ptr<Plan> plan = find(backward_key(dout, q, k, v, o, lse, causal, generation), &known);
    if (plan == nullptr) {  // Python's backward, which records a plan and exports it here
      py::gil_scoped_acquire gil;
      const double scale = 1.0 / std::sqrt(double(q.size(3)));
      py::tuple out = (*backward_miss)(dout, q, k, v, o, lse, causal, scale, generation);
      return {out[0].cast<at::Tensor>(), out[1].cast<at::Tensor>(), out[2].cast<at::Tensor>(), at::Tensor(),
              at::Tensor(), at::Tensor()};
    }
    at::Tensor ld = row_buffer(q.size(0) * q.size(1), q.size(2), q.options());
    at::Tensor dq = at::empty_like(q), dk = at::empty_like(k), dv = at::empty_like(v);
    std::vector<at::Tensor> tensors{dout, q, k, v, o, lse, ld, dq, dk, dv};
    if (plan->dq_rows >= 0)
      tensors.push_back(at::empty({q.size(0), q.size(1), plan->dq_rows, q.size(3)}, q.options().dtype(at::kFloat)));
    run(*plan, tensors, q);
    return {dq, dk, dv, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

bool eligible(const at::Tensor& t) {
  return t.defined() && t.is_cuda() && t.dim() == 4 &&
         (t.scalar_type() == at::kHalf || t.scalar_type() == at::kBFloat16);
}

// ------------------------------------------------------------------------------------------------
// What Python calls
// ------------------------------------------------------------------------------------------------

// The output through a plan; None where the key is unknown (Python may record a plan), False where it is known to
// have none.
py::object forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal,
                   int64_t generation) {
  if (!eligible(q) || !eligible(k) || !eligible(v) || k.device() != q.device() || v.device() != q.device())
    return py::none();  // the Python path validates (and refuses tensors on different devices)
  bool known = false;
  std::shared_ptr<Plan> plan = find(forward_key(q, k, v, causal, generation), &known);
  if (plan == nullptr) return known ? py::object(py::bool_(false)) : py::object(py::none());
  return py::cast(FlashAttention::apply(q, k, v, causal, generation, plan));
}

Key key_of(int64_t kind, const std::vector<at::Tensor>& t, bool causal, int64_t generation) {
  if (kind == kForward && t.size() == 3) return forward_key(t[0], t[1], t[2], causal, generation);
  if (kind == kBackward && t.size() == 6) return backward_key(t[0], t[1], t[2], t[3], t[4], t[5], causal, generation);
  throw std::invalid_argument("host entry: a forward key takes (q, k, v), a backward key (do, q, k, v, o, lse)");
}

// launches: per launch (function, (gx, gy, gz), block, shared, cooperative, pdl, template bytes, parameter
// offsets, pointer holes [(offset, tensor)], map holes [(offset, tensor, dtype, dims, strides, box, swizzle,
// fill)]). None: this key never replays here.
void add_plan(int64_t kind, const std::vector<at::Tensor>& key_tensors, bool causal, int64_t generation,
              int64_t dq_rows, const py::object& launches) {
  std::shared_ptr<Plan> plan;
  if (!launches.is_none()) {
    plan = std::make_shared<Plan>();
    plan->dq_rows = dq_rows;
    for (const py::handle item : launches) {
      const py::tuple l = item.cast<py::tuple>();
      Launch launch;
      launch.function = reinterpret_cast<CUfunction>(l[0].cast<uint64_t>());
      const py::tuple grid = l[1].cast<py::tuple>();
      for (int i = 0; i < 3; ++i) launch.grid[i] = grid[i].cast<unsigned>();
      launch.block = l[2].cast<unsigned>();
      launch.shared = l[3].cast<unsigned>();
      launch.cooperative = l[4].cast<bool>();
      launch.pdl = l[5].cast<bool>();
      const std::string bytes = l[6].cast<std::string>();
      const size_t size = (bytes.size() + 127) / 128 * 128 + 128;
      launch.bytes.reset(static_cast<uint8_t*>(std::aligned_alloc(128, size)));
      if (!launch.bytes) throw std::bad_alloc();
      std::memset(launch.bytes.get(), 0, size);
      std::memcpy(launch.bytes.get(), bytes.data(), bytes.size());
      for (const py::handle offset : l[7]) {
        const size_t at = offset.cast<size_t>();
        if (at >= bytes.size()) throw std::invalid_argument("host entry: a parameter offset lies past the template");
        launch.params.push_back(launch.bytes.get() + at);
      }
      for (const py::handle hole : l[8]) {
        const py::tuple h = hole.cast<py::tuple>();
        launch.pointers.push_back({h[0].cast<size_t>(), h[1].cast<int>()});
      }
      for (const py::handle hole : l[9]) {
        const py::tuple h = hole.cast<py::tuple>();
        MapHole map{};
        map.offset = h[0].cast<size_t>();
        map.tensor = h[1].cast<int>();
        map.dtype = static_cast<CUtensorMapDataType>(h[2].cast<int>());
        const auto dims = h[3].cast<std::vector<uint64_t>>();
        const auto strides = h[4].cast<std::vector<uint64_t>>();
        const auto box = h[5].cast<std::vector<uint32_t>>();
        if (dims.empty() || dims.size() > 5 || box.size() != dims.size() || strides.size() + 1 != dims.size())
          throw std::invalid_argument("host entry: a map hole needs rank 1-5 dims, rank - 1 strides and a box");
        map.rank = static_cast<cuuint32_t>(dims.size());
        for (size_t i = 0; i < dims.size(); ++i) map.dims[i] = dims[i], map.box[i] = box[i];
        for (size_t i = 0; i < strides.size(); ++i) map.strides[i] = strides[i];
        map.swizzle = static_cast<CUtensorMapSwizzle>(h[6].cast<int>());
        map.fill = static_cast<CUtensorMapFloatOOBfill>(h[7].cast<int>());
        launch.maps.push_back(std::move(map));
      }
      plan->launches.push_back(std::move(launch));
    }
  }
  Key key = key_of(kind, key_tensors, causal, generation);
  std::lock_guard<std::mutex> lock(plans_mutex);
  if (plans.size() >= kMaxPlans) plans.clear();
  plans[std::move(key)] = std::move(plan);
}

// (known, has a plan) for a key; for tests and for Python's "export once" check.
py::tuple lookup(int64_t kind, const std::vector<at::Tensor>& key_tensors, bool causal, int64_t generation) {
  bool known = false;
  const auto plan = find(key_of(kind, key_tensors, causal, generation), &known);
  return py::make_tuple(known, plan != nullptr);
}

// A launch's parameter bytes with its pointer holes filled from `tensors` (maps left as exported): what a replay
// hands cuLaunchKernelEx, for checks without a GPU.
py::bytes packed(int64_t kind, const std::vector<at::Tensor>& key_tensors, bool causal, int64_t generation,
                 size_t index, const std::vector<at::Tensor>& tensors) {
  bool known = false;
  auto plan = find(key_of(kind, key_tensors, causal, generation), &known);
  if (plan == nullptr || index >= plan->launches.size()) throw std::out_of_range("host entry: no such launch");
  std::lock_guard<std::mutex> lock(launch_mutex);
  Launch& launch = plan->launches[index];
  launch.fill(tensors);
  const auto* base = launch.bytes.get();
  const size_t end = launch.params.empty() ? 0 : static_cast<uint8_t*>(launch.params.back()) - base + 8;
  return py::bytes(reinterpret_cast<const char*>(base), end);
}

void clear() {
  std::lock_guard<std::mutex> lock(plans_mutex);
  plans.clear();
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "The C++ host entry of FlashAttentionTriton (see cs336_systems/attention/host_entry.py).";
  m.def("forward", &forward, "The attention output through a recorded plan, or None where there is none.");
  m.def("add_plan", &add_plan);
  m.def("lookup", &lookup);
  m.def("packed", &packed);
  m.def("clear", &clear);
  m.def("size", [] {
    std::lock_guard<std::mutex> lock(plans_mutex);
    return plans.size();
  });
  m.def("replays", [] { return replays.load(); });
  m.def("set_backward_miss", [](py::object fn) { *backward_miss = std::move(fn); });
}
