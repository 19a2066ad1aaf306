// add_mm (cublaslt_addmm.h): cuBLASLt's functions looked up in the copy torch has loaded, one plan per call
// signature.
#include "cublaslt_addmm.h"

#include <c10/util/Exception.h>
#include <dlfcn.h>
#include <link.h>

#if __has_include(<cublasLt.h>)
#include <cublasLt.h>
#define FLUXCOMPILE_HAS_LT 1
#else
#define FLUXCOMPILE_HAS_LT 0
#endif

#include <algorithm>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <vector>

namespace fluxcompile::pipelined {
namespace {

#if FLUXCOMPILE_HAS_LT
struct Lt {
  decltype(&cublasLtCreate) create = nullptr;
  decltype(&cublasLtMatmulDescCreate) desc_create = nullptr;
  decltype(&cublasLtMatmulDescSetAttribute) desc_set = nullptr;
  decltype(&cublasLtMatrixLayoutCreate) layout_create = nullptr;
  decltype(&cublasLtMatmulPreferenceCreate) pref_create = nullptr;
  decltype(&cublasLtMatmulPreferenceSetAttribute) pref_set = nullptr;
  decltype(&cublasLtMatmulAlgoGetHeuristic) heuristic = nullptr;
  decltype(&cublasLtMatmul) matmul = nullptr;
  decltype(&cublasLtMatmulPreferenceDestroy) pref_destroy = nullptr;
  decltype(&cublasLtMatmulDescDestroy) desc_destroy = nullptr;
  decltype(&cublasLtMatrixLayoutDestroy) layout_destroy = nullptr;
  bool ok = false;
};

// The path of a loaded library whose file name starts with `prefix` (empty: none).
std::string loaded_library(const char* prefix) {
  std::pair<const char*, std::string> search{prefix, ""};
  dl_iterate_phdr(
      [](struct dl_phdr_info* info, size_t, void* data) {
        auto* want = static_cast<std::pair<const char*, std::string>*>(data);
        const char* name = info->dlpi_name;
        const char* base = name != nullptr ? std::strrchr(name, '/') : nullptr;
        base = base != nullptr ? base + 1 : name;
        if (base == nullptr || std::strncmp(base, want->first, std::strlen(want->first)) != 0) return 0;
        want->second = name;
        return 1;
      },
      &search);
  return search.second;
}

const Lt& lt() {
  static const Lt api = [] {
    Lt a;
    const std::string path = loaded_library("libcublasLt.so");
    void* lib = path.empty() ? nullptr : dlopen(path.c_str(), RTLD_NOW | RTLD_NOLOAD);
    if (lib == nullptr) return a;
    auto get = [&](auto& fn, const char* name) { fn = reinterpret_cast<std::decay_t<decltype(fn)>>(dlsym(lib, name)); };
    get(a.create, "cublasLtCreate");
    get(a.desc_create, "cublasLtMatmulDescCreate");
    get(a.desc_set, "cublasLtMatmulDescSetAttribute");
    get(a.layout_create, "cublasLtMatrixLayoutCreate");
    get(a.pref_create, "cublasLtMatmulPreferenceCreate");
    get(a.pref_set, "cublasLtMatmulPreferenceSetAttribute");
    get(a.heuristic, "cublasLtMatmulAlgoGetHeuristic");
    get(a.matmul, "cublasLtMatmul");
    get(a.pref_destroy, "cublasLtMatmulPreferenceDestroy");
    get(a.desc_destroy, "cublasLtMatmulDescDestroy");
    get(a.layout_destroy, "cublasLtMatrixLayoutDestroy");
    a.ok = a.create && a.desc_create && a.desc_set && a.layout_create && a.pref_create && a.pref_set &&
           a.heuristic && a.matmul && a.pref_destroy && a.desc_destroy && a.layout_destroy;
    return a;
  }();
  return api;
}

// A row-major [rows, cols] operand as cuBLASLt's column-major [cols, rows] (its transpose), or transposed
// again where the operand itself is column-major. False if neither stride is 1.
struct Operand {
  cublasOperation_t op = CUBLAS_OP_N;
  uint64_t rows = 0, cols = 0;
  int64_t ld = 0;
};
bool as_operand(const at::Tensor& t, Operand& o) {
  const int64_t r = t.size(0), c = t.size(1);
  if (t.stride(1) == 1 && t.stride(0) >= std::max<int64_t>(c, 1)) {
    o = {CUBLAS_OP_N, static_cast<uint64_t>(c), static_cast<uint64_t>(r), t.stride(0)};
    return true;
  }
  if (t.stride(0) == 1 && t.stride(1) >= std::max<int64_t>(r, 1)) {
    o = {CUBLAS_OP_T, static_cast<uint64_t>(r), static_cast<uint64_t>(c), t.stride(1)};
    return true;
  }
  return false;
}

int64_t alignment(const void* p) {
  const auto v = reinterpret_cast<uintptr_t>(p);
  int64_t a = 256;
  while (a > 1 && v % a) a /= 2;
  return a;
}

// A call signature's descriptors and algorithm, made once and kept for the process, like replays (a failed
// plan keeps none).
struct LtPlan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulAlgo_t algo{};
  bool ok = false;
};

cudaDataType_t lt_type(at::ScalarType t) {
  switch (t) {
    case at::kBFloat16: return CUDA_R_16BF;
    case at::kHalf: return CUDA_R_16F;
    case at::kFloat8_e4m3fn: return CUDA_R_8F_E4M3;
    case at::kFloat8_e5m2: return CUDA_R_8F_E5M2;
    default: return CUDA_R_32F;
  }
}

// The per-device handles of both entries (made on first use, kept for the process).
constexpr int kMaxDevices = 64;
cublasLtHandle_t handle_for(const Lt& api, int device) {
  static cublasLtHandle_t handles[kMaxDevices] = {};
  if (handles[device] == nullptr && api.create(&handles[device]) != CUBLAS_STATUS_SUCCESS) handles[device] = nullptr;
  return handles[device];
}

// The heuristic's first algorithm for a plan's descriptors, with no workspace and the operands' alignments.
bool pick_algo(const Lt& api, cublasLtHandle_t handle, LtPlan& p, const std::vector<uint32_t>& align) {
  cublasLtMatmulPreference_t pref = nullptr;
  bool good = api.pref_create(&pref) == CUBLAS_STATUS_SUCCESS;
  auto pset = [&](cublasLtMatmulPreferenceAttributes_t attr, const void* v, size_t size) {
    good = good && api.pref_set(pref, attr, v, size) == CUBLAS_STATUS_SUCCESS;
  };
  const uint64_t no_workspace = 0;
  pset(CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &no_workspace, sizeof(no_workspace));
  pset(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &align[0], sizeof(uint32_t));
  pset(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &align[1], sizeof(uint32_t));
  pset(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &align[2], sizeof(uint32_t));
  pset(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &align[3], sizeof(uint32_t));
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  good = good && api.heuristic(handle, p.desc, p.a, p.b, p.c, p.c, pref, 1, &result, &found) == CUBLAS_STATUS_SUCCESS;
  if (pref != nullptr) api.pref_destroy(pref);
  if (good && found > 0) p.algo = result.algo;
  return good && found > 0;
}

void drop(const Lt& api, LtPlan& p) {
  if (p.desc != nullptr) api.desc_destroy(p.desc);
  for (cublasLtMatrixLayout_t l : {p.a, p.b, p.c})
    if (l != nullptr) api.layout_destroy(l);
  p = LtPlan{};
}

// Sets one attribute of a descriptor; false where cuBLASLt refuses it.
template <class T>
bool set_attr(const Lt& api, cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attr, const T& value) {
  return api.desc_set(desc, attr, &value, sizeof(value)) == CUBLAS_STATUS_SUCCESS;
}

// A plan's descriptor as both entries make it: fp32 compute, the operands' transposes, the bias epilogue where
// there is a bias. False where cuBLASLt refuses any of it.
bool make_desc(const Lt& api, LtPlan& p, const Operand& x, const Operand& y, bool bias) {
  if (api.desc_create(&p.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F) != CUBLAS_STATUS_SUCCESS) return false;
  bool good = set_attr(api, p.desc, CUBLASLT_MATMUL_DESC_TRANSA, x.op);
  good = good && set_attr(api, p.desc, CUBLASLT_MATMUL_DESC_TRANSB, y.op);
  return good && (!bias || set_attr(api, p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE, CUBLASLT_EPILOGUE_BIAS));
}

// D [m, n] (contiguous) = A [m, k] @ B [k, n] + C [m, n] (contiguous, not D) + bias [n]; one rounding.
// False where cuBLASLt is missing or offers no algorithm for these operands.
bool lt_add_mm(const at::Tensor& D, const at::Tensor& C, const at::Tensor& A, const at::Tensor& B,
               const std::optional<at::Tensor>& bias, const c10::cuda::CUDAStream& stream) {
  const Lt& api = lt();
  const auto device = D.device().index();
  if (!api.ok || device < 0 || device >= kMaxDevices) return false;
  Operand x, y;  // D^T = B^T A^T + C^T: our B is cuBLASLt's A (x), our A its B (y)
  if (!as_operand(B, x) || !as_operand(A, y)) return false;
  const auto dtype = D.scalar_type();
  const void* bias_ptr = bias.has_value() ? bias->data_ptr() : nullptr;
  const int64_t n = D.size(1), m = D.size(0);
  const int64_t align_x = alignment(B.data_ptr()), align_y = alignment(A.data_ptr());
  const int64_t align_c = alignment(C.data_ptr()), align_d = alignment(D.data_ptr());
  const std::vector<int64_t> key = {device, static_cast<int64_t>(dtype), m, n, A.size(1), static_cast<int64_t>(x.op),
                                    x.ld, static_cast<int64_t>(y.op), y.ld, bias_ptr != nullptr, align_x, align_y,
                                    align_c, align_d};
  // Held until the GEMM is enqueued: a plan's descriptor takes each call's bias pointer.
  static std::mutex mutex;
  std::lock_guard<std::mutex> lock(mutex);
  static std::map<std::vector<int64_t>, LtPlan> plans;
  const cublasLtHandle_t handle = handle_for(api, device);
  if (handle == nullptr) return false;
  auto it = plans.find(key);
  if (it == plans.end()) {
    LtPlan p;
    const cudaDataType_t t = lt_type(dtype);
    bool good = make_desc(api, p, x, y, bias_ptr != nullptr);
    good = good && api.layout_create(&p.a, t, x.rows, x.cols, x.ld) == CUBLAS_STATUS_SUCCESS;
    good = good && api.layout_create(&p.b, t, y.rows, y.cols, y.ld) == CUBLAS_STATUS_SUCCESS;
    good = good && api.layout_create(&p.c, t, n, m, n) == CUBLAS_STATUS_SUCCESS;  // C and D alike
    const std::vector<uint32_t> align = {static_cast<uint32_t>(align_x), static_cast<uint32_t>(align_y),
                                         static_cast<uint32_t>(align_c), static_cast<uint32_t>(align_d)};
    p.ok = good && pick_algo(api, handle, p, align);
    if (!p.ok) drop(api, p);
    it = plans.emplace(key, p).first;  // a failed plan is kept too: the fallback from then on
  }
  const LtPlan& plan = it->second;
  if (!plan.ok) return false;
  if (bias_ptr != nullptr && !set_attr(api, plan.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, bias_ptr)) return false;
  const float one = 1.0f;
  const cublasStatus_t rc = api.matmul(handle, plan.desc, &one, B.data_ptr(), plan.a, A.data_ptr(), plan.b, &one,
                                       C.data_ptr(), plan.c, D.data_ptr(), plan.c, &plan.algo, nullptr, 0,
                                       stream.stream());
  TORCH_CHECK(rc == CUBLAS_STATUS_SUCCESS, "fluxcompile: cublasLtMatmul failed (", static_cast<int>(rc), ")");
  return true;
}
#endif

}  // namespace

bool lt_scaled_mm(const at::Tensor& D, const at::Tensor& A, const at::Tensor& B, const at::Tensor& scale_a,
                  const at::Tensor& scale_b, const std::optional<at::Tensor>& bias, bool fast_accum,
                  const c10::cuda::CUDAStream& stream) {
#if FLUXCOMPILE_HAS_LT
  const Lt& api = lt();
  const auto device = D.device().index();
  if (!api.ok || device < 0 || device >= kMaxDevices || !D.is_contiguous() || scale_a.numel() != 1 ||
      scale_b.numel() != 1 || scale_a.scalar_type() != at::kFloat || scale_b.scalar_type() != at::kFloat)
    return false;
  // D^T = B^T A^T: our B (column-major) is cuBLASLt's A, transposed; our A (row-major) its B: the "TN" form
  // that Hopper's fp8 GEMMs take.
  Operand x, y;
  if (!as_operand(B, x) || !as_operand(A, y) || x.op != CUBLAS_OP_T || y.op != CUBLAS_OP_N) return false;
  const void* bias_ptr = bias.has_value() ? bias->data_ptr() : nullptr;
  if (bias_ptr != nullptr && (bias->scalar_type() != D.scalar_type() || !bias->is_contiguous())) return false;
  const int64_t n = D.size(1), m = D.size(0);
  const uint32_t align_x = alignment(B.data_ptr()), align_y = alignment(A.data_ptr()), align_d = alignment(D.data_ptr());
  const std::vector<int64_t> key = {device, static_cast<int64_t>(A.scalar_type()), static_cast<int64_t>(B.scalar_type()),
                                    static_cast<int64_t>(D.scalar_type()), m, n, A.size(1), x.ld, y.ld,
                                    bias_ptr != nullptr, fast_accum, align_x, align_y, align_d};
  static std::mutex mutex;  // held until the GEMM is enqueued: the descriptor takes each call's pointers
  std::lock_guard<std::mutex> lock(mutex);
  static std::map<std::vector<int64_t>, LtPlan> plans;
  const cublasLtHandle_t handle = handle_for(api, device);
  if (handle == nullptr) return false;
  auto it = plans.find(key);
  if (it == plans.end()) {
    LtPlan p;
    bool good = make_desc(api, p, x, y, bias_ptr != nullptr);
    good = good && set_attr(api, p.desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, static_cast<int8_t>(fast_accum ? 1 : 0));
    if (bias_ptr != nullptr)
      good = good && set_attr(api, p.desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, lt_type(D.scalar_type()));
    // Placeholders for the heuristic: each call sets its own scale pointers.
    const void* unset = scale_a.data_ptr();
    good = good && set_attr(api, p.desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, unset);
    good = good && set_attr(api, p.desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, unset);
    good = good && api.layout_create(&p.a, lt_type(B.scalar_type()), x.rows, x.cols, x.ld) == CUBLAS_STATUS_SUCCESS;
    good = good && api.layout_create(&p.b, lt_type(A.scalar_type()), y.rows, y.cols, y.ld) == CUBLAS_STATUS_SUCCESS;
    good = good && api.layout_create(&p.c, lt_type(D.scalar_type()), n, m, n) == CUBLAS_STATUS_SUCCESS;
    p.ok = good && pick_algo(api, handle, p, {align_x, align_y, align_d, align_d});
    if (!p.ok) drop(api, p);
    it = plans.emplace(key, p).first;  // a failed plan is kept too: the fallback from then on
  }
  const LtPlan& plan = it->second;
  if (!plan.ok) return false;
  // cuBLASLt's A is our B: its scale is scale_b; its B is our A.
  const void* sa = scale_b.data_ptr();
  const void* sb = scale_a.data_ptr();
  bool good = set_attr(api, plan.desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, sa);
  good = good && set_attr(api, plan.desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, sb);
  if (bias_ptr != nullptr) good = good && set_attr(api, plan.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, bias_ptr);
  if (!good) return false;
  const float one = 1.0f, zero = 0.0f;
  const cublasStatus_t rc = api.matmul(handle, plan.desc, &one, B.data_ptr(), plan.a, A.data_ptr(), plan.b, &zero,
                                       D.data_ptr(), plan.c, D.data_ptr(), plan.c, &plan.algo, nullptr, 0,
                                       stream.stream());
  TORCH_CHECK(rc == CUBLAS_STATUS_SUCCESS, "fluxcompile: cublasLtMatmul (fp8) failed (", static_cast<int>(rc), ")");
  return true;
#else
  return false;
#endif
}

bool lt_available() {
#if FLUXCOMPILE_HAS_LT
  return lt().ok;
#else
  return false;
#endif
}

void add_mm(at::Tensor D, const at::Tensor& C, const at::Tensor& A, const at::Tensor& B,
            const std::optional<at::Tensor>& bias, const c10::cuda::CUDAStream& stream) {
#if FLUXCOMPILE_HAS_LT
  if (D.is_contiguous() && C.is_contiguous() && lt_add_mm(D, C, A, B, bias, stream)) return;
#endif
  at::addmm_out(D, C, A, B);
  if (bias.has_value()) D.add_(*bias);
}

}  // namespace fluxcompile::pipelined
