// Host sequencers of the cuBLAS-pipelined choices (fluxcompile/lowerings/all_gather_matmul/cublas_pipelined.py
// and matmul_reduce_scatter/cublas_pipelined.py): the only implementation of their stream sequences.
//
// A call issues ten to thirty stream operations; from Python each costs as much host time as a small GEMM's
// GPU time, so they are issued here. Slot views, flag addresses and the order of the peers are precomputed
// once per call signature by the Python side (its "plan", with the order and flags of
// fluxcompile/symm_mem/exchange.py); this file only issues the GEMMs, copies, events and flag memory operations.
//
// Flags are 32-bit words in symmetric memory, set and awaited by the GPU front end (cuStreamWriteValue32 /
// cuStreamWaitValue32, no SM), with the protocol of fluxcompile/symm_mem/signals.py.
#include <torch/extension.h>

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda.h>
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <link.h>

#if __has_include(<cublasLt.h>)
#include <cublasLt.h>
#define FLUXCOMPILE_HAS_LT 1
#else
#define FLUXCOMPILE_HAS_LT 0
#endif

#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

namespace {

using MemOpFn = CUresult (*)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);

struct MemOps {
  MemOpFn wait = nullptr;
  MemOpFn write = nullptr;
};

MemOpFn entry_point(const char* name) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found{};
  // Through the runtime, so the module needs no link against libcuda; 12000: the CUDA 12 signatures.
  cudaError_t rc = cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault, &found);
  TORCH_CHECK(rc == cudaSuccess && found == cudaDriverEntryPointSuccess && fn != nullptr,
              "fluxcompile: the CUDA driver has no ", name);
  return reinterpret_cast<MemOpFn>(fn);
}

const MemOps& memops() {
  static const MemOps ops{entry_point("cuStreamWaitValue32"), entry_point("cuStreamWriteValue32")};
  return ops;
}

void wait_flag(const c10::cuda::CUDAStream& s, int64_t addr, uint32_t value) {
  CUresult rc = memops().wait(reinterpret_cast<CUstream>(s.stream()), static_cast<CUdeviceptr>(addr), value,
                              CU_STREAM_WAIT_VALUE_EQ);
  TORCH_CHECK(rc == CUDA_SUCCESS, "fluxcompile: cuStreamWaitValue32 failed (", static_cast<int>(rc), ")");
}

void write_flag(const c10::cuda::CUDAStream& s, int64_t addr, uint32_t value) {
  CUresult rc = memops().write(reinterpret_cast<CUstream>(s.stream()), static_cast<CUdeviceptr>(addr), value,
                               CU_STREAM_WRITE_VALUE_DEFAULT);
  TORCH_CHECK(rc == CUDA_SUCCESS, "fluxcompile: cuStreamWriteValue32 failed (", static_cast<int>(rc), ")");
}

// The waiter's half of the protocol (signals.stream_consume): wait until the flag is 1, then reset it to 0.
void consume_flag(const c10::cuda::CUDAStream& s, int64_t addr) {
  wait_flag(s, addr, 1);
  write_flag(s, addr, 0);
}

// `waiter` waits for everything queued on `producer` so far (torch.cuda.Stream.wait_stream). One event per
// device serves every join: a wait takes the event's state when it is issued, and each record here is
// followed by its wait at once (inside graph capture the pair becomes a graph edge). Creating and
// destroying an event per join would cost host time on every call.
void join(const c10::cuda::CUDAStream& waiter, const c10::cuda::CUDAStream& producer) {
  static std::vector<cudaEvent_t> events;  // by device index
  const auto device = static_cast<size_t>(producer.device_index());
  if (events.size() <= device) events.resize(device + 1, nullptr);
  if (events[device] == nullptr) {
    C10_CUDA_CHECK(cudaEventCreateWithFlags(&events[device], cudaEventDisableTiming));
  }
  C10_CUDA_CHECK(cudaEventRecord(events[device], producer.stream()));
  C10_CUDA_CHECK(cudaStreamWaitEvent(waiter.stream(), events[device], 0));
}

// The all-gather sequences' GEMM stream: one high-priority stream per device, forked from the caller's. The
// gathered output's rows are SM copies on the side stream that often become ready when a GEMM does; at equal
// priority either may take the SMs first, and a copy that wins holds up the GEMM, which cuBLAS runs on every
// SM. At lower priority the copy takes only what the GEMM leaves (its last wave). Graph replays keep the
// priority (cudaGraphInstantiateFlagUseNodePriority).
c10::cuda::CUDAStream gemm_stream(c10::DeviceIndex device) {
  static std::mutex mu;
  static std::map<c10::DeviceIndex, c10::cuda::CUDAStream> streams;
  std::lock_guard<std::mutex> lock(mu);
  auto it = streams.find(device);
  if (it == streams.end()) it = streams.emplace(device, c10::cuda::getStreamFromPool(true, device)).first;
  return it->second;
}

// Issues sequence(main) with main = the GEMM stream, current and forked from the caller's stream, which waits
// for it at the end.
template <typename F>
void on_gemm_stream(const c10::cuda::CUDAStream& gemms, F&& sequence) {
  const auto caller = c10::cuda::getCurrentCUDAStream(gemms.device_index());
  join(gemms, caller);
  {
    c10::cuda::CUDAStreamGuard on_gemms(gemms);
    sequence(gemms);
  }
  join(caller, gemms);
}

// dst <- src on stream s: the cudaMemcpyAsync that Tensor::copy_ issues for contiguous same-dtype tensors
// of one device (a peer's mapped buffer counts as this device's: the copy engine moves it over NVLink),
// without the dispatcher's host cost.
void copy_async(const at::Tensor& dst, const at::Tensor& src, const c10::cuda::CUDAStream& s) {
  TORCH_CHECK(dst.is_contiguous() && src.is_contiguous() && dst.dtype() == src.dtype() &&
                  dst.numel() == src.numel(),
              "fluxcompile: copy_async needs contiguous tensors of one dtype and size");
  C10_CUDA_CHECK(cudaMemcpyAsync(dst.data_ptr(), src.data_ptr(), src.nbytes(), cudaMemcpyDeviceToDevice, s.stream()));
}

c10::cuda::CUDAStream external(int64_t handle, c10::DeviceIndex device) {
  return c10::cuda::getStreamFromExternal(reinterpret_cast<cudaStream_t>(handle), device);
}

void check_lengths(size_t n, std::initializer_list<size_t> sizes) {
  for (size_t s : sizes) TORCH_CHECK(s == n, "fluxcompile: plan lists of different lengths");
}

// ---------------------------------------------------------------------------------------------
// Replays. A sequence below is a pure function of its arguments: the same pointers, shapes, flag addresses
// and streams enqueue the same work. So a call whose arguments (outputs included: they are allocated
// before the sequence) were seen before is captured once as a CUDA graph and replayed from then on: one
// graph launch instead of the 10-30 stream operations, at a fraction of their host time.
// In a training step or a prefill loop the caching allocator hands out the same addresses every step, so
// the keys repeat. Rules:
// - a key is captured the second time it is seen (a one-off call is not worth a capture), at most
//   `limit` graphs per process (then new keys run directly: a workload whose addresses never repeat costs
//   `limit` captures once, not one per call); limit 0 turns replays off;
// - inside the caller's own capture (vLLM's decode graphs) the sequence is issued as it is, into that graph;
// - a capture that fails (or allocates: see Replays::capture) leaves its key to run directly from then on;
//   after a few such failures nothing new is captured.
// Replaying or not makes no difference to the GPU's work, so ranks need not agree on it.
class Key {
 public:
  void add(int64_t v) { words_.push_back(v); }
  void add(const at::Tensor& t) {
    if (!t.defined()) return add(-1);
    add(reinterpret_cast<int64_t>(t.data_ptr()));
    add(static_cast<int64_t>(t.scalar_type()));
    add(t.dim());
    for (int64_t d = 0; d < t.dim(); ++d) {
      add(t.size(d));
      add(t.stride(d));
    }
  }
  void add(const std::optional<at::Tensor>& t) { t.has_value() ? add(*t) : add(-2); }
  template <class T>
  void add(const std::vector<T>& xs) {
    add(static_cast<int64_t>(xs.size()));
    for (const auto& x : xs) add(x);
  }
  const std::vector<int64_t>& words() const { return words_; }

 private:
  std::vector<int64_t> words_;
};

template <class... Args>
std::vector<int64_t> key_of(const Args&... args) {
  Key k;
  (k.add(args), ...);
  return k.words();
}

struct KeyHash {
  size_t operator()(const std::vector<int64_t>& w) const {
    uint64_t h = 1469598103934665603ull;  // FNV-1a over the words
    for (int64_t x : w) h = (h ^ static_cast<uint64_t>(x)) * 1099511628211ull;
    return static_cast<size_t>(h);
  }
};

struct ReplayStats {
  int64_t replays = 0, captures = 0, direct = 0, failed = 0;
};

// An instantiated capture.
class Graph {
 public:
  explicit Graph(cudaGraphExec_t exec) : exec_(exec) {}
  Graph(const Graph&) = delete;
  Graph& operator=(const Graph&) = delete;
  ~Graph() { (void)cudaGraphExecDestroy(exec_); }  // one in flight is freed when it completes
  void launch(cudaStream_t s) const { C10_CUDA_CHECK(cudaGraphLaunch(exec_, s)); }

 private:
  cudaGraphExec_t exec_;
};

class Replays {
 public:
  // issue() enqueues the sequence on the current stream; it runs directly, or into a new graph (then
  // replayed), or not at all where its graph is replayed. gemm_streams: the streams other than the current
  // one that issue() runs GEMMs on.
  template <class F>
  void run(std::vector<int64_t> key, int64_t limit, c10::DeviceIndex device, F&& issue,
           const std::vector<c10::cuda::CUDAStream>& gemm_streams = {}) {
    const auto current = c10::cuda::getCurrentCUDAStream(device);
    if (limit <= 0 || capturing(current)) return direct(issue);
    key.push_back(device);
    key.push_back(blas_settings());
    auto it = graphs_.find(key);
    if (it != graphs_.end()) {
      it->second->launch(current.stream());
      ++stats_.replays;
      return;
    }
    if (static_cast<int64_t>(graphs_.size()) >= limit || stats_.failed >= kMaxFailures || refused_.count(key) ||
        first_sight(key))
      return direct(issue);
    std::string why;
    std::unique_ptr<Graph> graph = capture(device, issue, gemm_streams, why);
    if (!graph) {
      refused_.emplace(std::move(key), true);
      last_failure_ = why;
      if (++stats_.failed == 1 || stats_.failed == kMaxFailures) {
        TORCH_WARN("fluxcompile: a pipelined sequence could not be captured as a CUDA graph (", why,
                   "); it runs directly", stats_.failed == kMaxFailures ? ", and so will every new one from now" : "");
      }
      return direct(issue);  // a bad argument throws here, as it would have without replays
    }
    graph->launch(current.stream());
    ++stats_.captures;
    graphs_.emplace(std::move(key), std::move(graph));
  }

  std::vector<int64_t> stats() const {
    return {stats_.replays, stats_.captures, stats_.direct, stats_.failed, static_cast<int64_t>(graphs_.size())};
  }
  // Why the last capture that failed since clear() failed (empty: none failed).
  const std::string& last_failure() const { return last_failure_; }
  void clear() {
    graphs_.clear();
    seen_.clear();
    refused_.clear();
    stats_ = {};
    last_failure_.clear();
  }

 private:
  static constexpr int64_t kMaxFailures = 8;  // then capturing stops for the process

  // The capture uses CUDA's stream capture directly, not torch's CUDAGraph: that one also puts the
  // caching allocator and the RNG into capture mode, and a capture that fails part-way leaves both stuck
  // there. Instead a capture during which the caching allocator handed out memory is thrown away (such a
  // block would return to the general pool while the graph still used it); the sequences allocate
  // nothing, their outputs come before.
  template <class F>
  std::unique_ptr<Graph> capture(c10::DeviceIndex device, F&& issue,
                                 const std::vector<c10::cuda::CUDAStream>& gemm_streams, std::string& why) {
    const auto cs = capture_stream(device);
    warm_blas(cs);  // before the count: they may allocate
    for (const auto& s : gemm_streams) warm_blas(s);
    Handed before;
    if (!handed_out(device, before)) {
      why = "the caching allocator keeps no statistics here";
      return nullptr;
    }
    cudaGraph_t g = nullptr;
    {
      c10::cuda::CUDAStreamGuard on_capture(cs);
      // Thread-local: CUDA calls of other threads (NCCL's watchdog) do not break the capture.
      C10_CUDA_CHECK(cudaStreamBeginCapture(cs.stream(), cudaStreamCaptureModeThreadLocal));
      try {
        issue();
      } catch (const c10::Error& e) {
        why = e.what_without_backtrace();  // what() appends a C++ stack trace
      } catch (const std::exception& e) {
        why = e.what();
      }
      cudaError_t rc = cudaStreamEndCapture(cs.stream(), &g);  // also when issue() threw: leave capture mode
      if (rc != cudaSuccess && why.empty()) why = "cudaStreamEndCapture: " + error_text(rc);
      (void)cudaGetLastError();  // capture errors are not sticky; clear the last one
    }
    Handed after;
    if (!handed_out(device, after)) {
      if (why.empty()) why = "the caching allocator's statistics became unreadable";
    } else if (after.blocks != before.blocks) {
      // The count is the device's, so another thread's allocation in the window counts too. The sizes tell
      // what it was: a cuBLAS workspace has CUBLAS_WORKSPACE_CONFIG's size (by default 32 MiB on Hopper), a
      // cuBLASLt workspace of its own CUBLASLT_WORKSPACE_SIZE's (by default 1 MiB).
      const std::string what = std::to_string(after.blocks - before.blocks) + " block(s) of " +
                               std::to_string(after.bytes - before.bytes) +
                               " bytes in all, counted on the device (any thread's)";
      why = why.empty() ? "memory was allocated during capture: " + what
                        : why + " (memory was allocated during capture too: " + what + ")";
    }
    cudaGraphExec_t exec = nullptr;
    if (why.empty()) {
      cudaError_t rc = cudaGraphInstantiateWithFlags(&exec, g, cudaGraphInstantiateFlagUseNodePriority);
      if (rc != cudaSuccess) {
        why = "cudaGraphInstantiate: " + error_text(rc);
        (void)cudaGetLastError();
      }
    }
    if (g != nullptr) (void)cudaGraphDestroy(g);
    if (!why.empty()) return nullptr;
    return std::make_unique<Graph>(exec);
  }

  // The cuBLAS settings a capture bakes in that a user may change between calls (reduced-precision
  // reductions of fp16/bf16 GEMMs). TF32 is left out: reading it throws where the old and new precision
  // APIs were mixed, and these sequences run fp16/bf16 in practice.
  static int64_t blas_settings() {
    const auto& ctx = at::globalContext();
    return static_cast<int64_t>(ctx.allowFP16ReductionCuBLAS()) |
           static_cast<int64_t>(ctx.allowBF16ReductionCuBLAS()) << 4;
  }

  // How many blocks, and bytes, the caching allocator has handed out on `device`, ever.
  struct Handed {
    int64_t blocks = 0, bytes = 0;
  };
  static bool handed_out(c10::DeviceIndex device, Handed& h) {  // false if it cannot say
    try {
      const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device);
      h = {stats.allocation[0].allocated, stats.allocated_bytes[0].allocated};  // [0]: all pools
      return true;
    } catch (const std::exception&) {
      return false;
    }
  }

  static std::string error_text(cudaError_t rc) {
    return std::string(cudaGetErrorName(rc)) + " (" + cudaGetErrorString(rc) + ")";
  }
  template <class F>
  void direct(F&& issue) {
    ++stats_.direct;
    issue();
  }
  static bool capturing(const c10::cuda::CUDAStream& s) {
    cudaStreamCaptureStatus status{};
    C10_CUDA_CHECK(cudaStreamIsCapturing(s.stream(), &status));
    return status != cudaStreamCaptureStatusNone;
  }
  bool first_sight(const std::vector<int64_t>& key) {
    if (seen_.size() > 4096) seen_.clear();  // keys that never came back
    return seen_.emplace(key, true).second;
  }
  // A stream of our own per device (never the legacy default stream, which cannot capture). One from
  // torch's pool may be the side or a compute stream of these very sequences (torch.cuda.Stream() draws
  // from that pool), which would fold their branches into one.
  static c10::cuda::CUDAStream capture_stream(c10::DeviceIndex device) {
    static std::unordered_map<c10::DeviceIndex, cudaStream_t> streams;
    auto it = streams.find(device);
    if (it == streams.end()) {
      cudaStream_t raw = nullptr;
      C10_CUDA_CHECK(cudaStreamCreateWithFlags(&raw, cudaStreamNonBlocking));  // the current device's (guarded)
      it = streams.emplace(device, raw).first;
    }
    return c10::cuda::getStreamFromExternal(it->second, device);
  }

  // Makes the cuBLAS and cuBLASLt workspaces of this thread's GEMMs on `s`, where they are missing: made
  // during a capture they would count as an allocation. torch keeps one per (cuBLAS handle, stream), with a
  // handle per thread, and drops them all at torch._C._cuda_clearCublasWorkspaces(), which Inductor's CUDA
  // graph trees call around each recording; so this runs before every capture (once per captured key), on the
  // capturing thread. Real GEMMs, plain and with a bias, rather than torch's workspace functions: they make
  // whatever workspaces this torch version's GEMM paths use.
  // No synchronization: the workspaces are made on the host, and the scratch GEMMs may run whenever.
  static void warm_blas(const c10::cuda::CUDAStream& s) {
    c10::cuda::CUDAStreamGuard on_s(s);
    for (auto dtype : {at::kBFloat16, at::kHalf, at::kFloat}) {
      at::Tensor a = at::ones({16, 16}, at::TensorOptions().dtype(dtype).device(s.device()));
      at::Tensor bias = at::ones({16}, a.options());
      at::mm(a, a);
      at::addmm(bias, a, a);  // the cuBLASLt path (bias epilogue)
    }
  }

  std::unordered_map<std::vector<int64_t>, std::unique_ptr<Graph>, KeyHash> graphs_;
  std::unordered_map<std::vector<int64_t>, bool, KeyHash> seen_, refused_;
  ReplayStats stats_;
  std::string last_failure_;
};

// Which sequence a key belongs to (its first word).
enum SequenceId : int64_t {
  kRsPipelined = 1, kAgPipelined, kRsTail, kAgUnsplit, kAgLead, kAgStages, kRsStages, kRsAddmm
};

Replays& replays() {
  static Replays* r = new Replays();  // never destroyed: graphs must not be freed after the CUDA context
  return *r;
}

// On `side`: once the peer has freed its slot (its done flag), the copy engine moves `src` into it (peer to
// peer), then the peer's ready flag.
void send_block(const c10::cuda::CUDAStream& side, int64_t done, const at::Tensor& dst, const at::Tensor& src,
                int64_t ready) {
  consume_flag(side, done);
  copy_async(dst, src, side);  // peer-to-peer: the copy engine
  write_flag(side, ready, 1);
}

// All-gather, on the side stream once A is ready: our shard into each peer's slot (the copy engine, once
// the peer has freed it), then into our rows of the gathered output.
void push_shard(const c10::cuda::CUDAStream& side, const c10::cuda::CUDAStream& main, const at::Tensor& a_local,
                std::vector<at::Tensor>& peer_slots, const std::vector<int64_t>& done_mine,
                const std::vector<int64_t>& ready_theirs, const at::Tensor& rows_of, int64_t rank) {
  join(side, main);
  // The send lists come in the plan's send order (exchange.gather_send_order).
  for (size_t j = 0; j < peer_slots.size(); ++j) send_block(side, done_mine[j], peer_slots[j], a_local, ready_theirs[j]);
  copy_async(rows_of.select(0, rank), a_local, side);
}

// Reduce-scatter, once the peers' partials of our rows have landed: ours (`mine`; for > 2 ranks already in
// our slot) plus theirs, into `out`; then our slots are free again for the peers (after `side`'s pushes, if any: they
// read our staging).
void reduce_and_release(const c10::cuda::CUDAStream& main, const std::optional<c10::cuda::CUDAStream>& side,
                        const at::Tensor& mine, const at::Tensor& own_slots, const std::vector<int64_t>& order,
                        const std::vector<int64_t>& ready_mine, const std::vector<int64_t>& done_theirs,
                        const at::Tensor& out, int64_t rows) {
  for (int64_t addr : ready_mine) consume_flag(main, addr);
  at::Tensor out2 = out.view({rows, own_slots.size(2)});
  if (own_slots.size(0) == 1) {
    out2.copy_(mine);  // one rank (tests of the sequences themselves: the choices decline it)
  } else if (own_slots.size(0) == 2) {
    at::add_out(out2, mine, own_slots.select(0, order[0]));  // fp32 math, one rounding
  } else {
    at::sum_out(out2, own_slots, std::vector<int64_t>{0});  // accumulates in fp32, rounds once
  }
  if (side.has_value()) join(main, *side);
  for (int64_t addr : done_theirs) write_flag(main, addr, 1);
}

// dst <- sum_i As[i][lo : lo + count] @ Bs[i] (+ bias): the bias goes into the first product and later
// products accumulate in cuBLAS (fp32) over the sum so far, as in the reference (ops.matmul_sum).
void matmul_rows(const std::vector<at::Tensor>& As, const std::vector<at::Tensor>& Bs,
                 const std::optional<at::Tensor>& bias, int64_t lo, int64_t count, at::Tensor dst) {
  if (bias.has_value()) {
    at::addmm_out(dst, *bias, As[0].narrow(0, lo, count), Bs[0]);
  } else {
    at::mm_out(dst, As[0].narrow(0, lo, count), Bs[0]);
  }
  for (size_t i = 1; i < As.size(); ++i) dst.addmm_(As[i].narrow(0, lo, count), Bs[i]);
}

// ---------------------------------------------------------------------------------------------
// D = A @ B + C (+ bias) with C and D apart, by cuBLASLt: the sum rides in the GEMM's epilogue, where
// at::addmm_out would first copy C into D. cuBLASLt's functions are looked up in the copy that torch has
// loaded (no link against it, no second copy); where there is none, or its heuristic offers no algorithm
// for the operands, add_mm falls back to at::addmm_out. No workspace: nothing is allocated (a replay's
// capture forbids it) and nothing is shared between streams.
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
  return t == at::kBFloat16 ? CUDA_R_16BF : t == at::kHalf ? CUDA_R_16F : CUDA_R_32F;
}

// D [m, n] (contiguous) = A [m, k] @ B [k, n] + C [m, n] (contiguous, not D) + bias [n]; one rounding.
// False where cuBLASLt is missing or offers no algorithm for these operands.
bool lt_add_mm(const at::Tensor& D, const at::Tensor& C, const at::Tensor& A, const at::Tensor& B,
               const std::optional<at::Tensor>& bias, const c10::cuda::CUDAStream& stream) {
  const Lt& api = lt();
  const auto device = D.device().index();
  constexpr int kMaxDevices = 64;  // the per-device handles below
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
  static cublasLtHandle_t handles[kMaxDevices] = {};
  if (handles[device] == nullptr && api.create(&handles[device]) != CUBLAS_STATUS_SUCCESS) {
    handles[device] = nullptr;
    return false;
  }
  const cublasLtHandle_t handle = handles[device];
  auto it = plans.find(key);
  if (it == plans.end()) {
    LtPlan p;
    const cudaDataType_t t = lt_type(dtype);
    bool good = api.desc_create(&p.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F) == CUBLAS_STATUS_SUCCESS;
    auto set = [&](cublasLtMatmulDescAttributes_t attr, const void* v, size_t size) {
      good = good && api.desc_set(p.desc, attr, v, size) == CUBLAS_STATUS_SUCCESS;
    };
    set(CUBLASLT_MATMUL_DESC_TRANSA, &x.op, sizeof(x.op));
    set(CUBLASLT_MATMUL_DESC_TRANSB, &y.op, sizeof(y.op));
    if (bias_ptr != nullptr) {
      const cublasLtEpilogue_t epi = CUBLASLT_EPILOGUE_BIAS;
      set(CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof(epi));
    }
    good = good && api.layout_create(&p.a, t, x.rows, x.cols, x.ld) == CUBLAS_STATUS_SUCCESS;
    good = good && api.layout_create(&p.b, t, y.rows, y.cols, y.ld) == CUBLAS_STATUS_SUCCESS;
    good = good && api.layout_create(&p.c, t, n, m, n) == CUBLAS_STATUS_SUCCESS;  // C and D alike
    cublasLtMatmulPreference_t pref = nullptr;
    good = good && api.pref_create(&pref) == CUBLAS_STATUS_SUCCESS;
    auto pset = [&](cublasLtMatmulPreferenceAttributes_t attr, const void* v, size_t size) {
      good = good && api.pref_set(pref, attr, v, size) == CUBLAS_STATUS_SUCCESS;
    };
    const uint64_t no_workspace = 0;
    const uint32_t align[4] = {static_cast<uint32_t>(align_x), static_cast<uint32_t>(align_y),
                               static_cast<uint32_t>(align_c), static_cast<uint32_t>(align_d)};
    pset(CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &no_workspace, sizeof(no_workspace));
    pset(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &align[0], sizeof(uint32_t));
    pset(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &align[1], sizeof(uint32_t));
    pset(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &align[2], sizeof(uint32_t));
    pset(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &align[3], sizeof(uint32_t));
    cublasLtMatmulHeuristicResult_t result{};
    int found = 0;
    good = good && api.heuristic(handle, p.desc, p.a, p.b, p.c, p.c, pref, 1, &result, &found) ==
                       CUBLAS_STATUS_SUCCESS;
    if (pref != nullptr) api.pref_destroy(pref);
    p.ok = good && found > 0;
    if (p.ok) {
      p.algo = result.algo;
    } else {
      if (p.desc != nullptr) api.desc_destroy(p.desc);
      for (cublasLtMatrixLayout_t l : {p.a, p.b, p.c})
        if (l != nullptr) api.layout_destroy(l);
      p = LtPlan{};
    }
    it = plans.emplace(key, p).first;  // a failed plan is kept too: the fallback from then on
  }
  const LtPlan& plan = it->second;
  if (!plan.ok) return false;
  if (bias_ptr != nullptr &&
      api.desc_set(plan.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias_ptr, sizeof(bias_ptr)) != CUBLAS_STATUS_SUCCESS)
    return false;
  const float one = 1.0f;
  const cublasStatus_t rc = api.matmul(handle, plan.desc, &one, B.data_ptr(), plan.a, A.data_ptr(), plan.b, &one,
                                       C.data_ptr(), plan.c, D.data_ptr(), plan.c, &plan.algo, nullptr, 0,
                                       stream.stream());
  TORCH_CHECK(rc == CUBLAS_STATUS_SUCCESS, "fluxcompile: cublasLtMatmul failed (", static_cast<int>(rc), ")");
  return true;
}
#endif

bool lt_available() {
#if FLUXCOMPILE_HAS_LT
  return lt().ok;
#else
  return false;
#endif
}

// D = A @ B + C (+ bias), C and D apart, one rounding where cuBLASLt does it (else at::addmm_out: C is copied
// into D first).
void add_mm(at::Tensor D, const at::Tensor& C, const at::Tensor& A, const at::Tensor& B,
            const std::optional<at::Tensor>& bias, const c10::cuda::CUDAStream& stream) {
#if FLUXCOMPILE_HAS_LT
  if (D.is_contiguous() && C.is_contiguous() && lt_add_mm(D, C, A, B, bias, stream)) return;
#endif
  at::addmm_out(D, C, A, B);
  if (bias.has_value()) D.add_(*bias);
}

// ---------------------------------------------------------------------------------------------
// GEMM -> reduce-scatter (matmul_reduce_scatter/cublas_pipelined.py). Lists indexed j run over the peers in ring
// order, which is also the order a reduce-scatter sends in (exchange.py):
//   peer_slots[j]   slot `rank` in peer order[j]'s buffer (zero-copy: cuBLAS writes there)
//   stage_slots[j]  push only: our local staging slot for order[j]'s rows
//   done_mine[j]    done flag of peer order[j] in our flags (may we write into its slot?)
//   ready_theirs[j] ready flag `rank` in order[j]'s flags (our partial has landed there)
//   ready_mine[j]   ready flag order[j] in our flags (its partial of our rows has landed)
//   done_theirs[j]  done flag `rank` in order[j]'s flags (our slot of its partial is free again)
// own_slot: slot `rank` of our buffer; own_slots: [world, rows, n], our slots by source rank.
at::Tensor rs_pipelined(const std::vector<at::Tensor>& As, const std::vector<at::Tensor>& Bs,
                        const std::optional<at::Tensor>& bias, std::vector<at::Tensor> peer_slots,
                        const std::vector<at::Tensor>& stage_slots, const at::Tensor& own_slot,
                        const at::Tensor& own_slots, const std::vector<int64_t>& order,
                        const std::vector<int64_t>& done_mine, const std::vector<int64_t>& ready_theirs,
                        const std::vector<int64_t>& ready_mine, const std::vector<int64_t>& done_theirs,
                        const std::vector<int64_t>& out_shape, int64_t rank, int64_t rows, bool push,
                        int64_t side_handle, int64_t graphs) {
  TORCH_CHECK(!As.empty() && As.size() == Bs.size(), "fluxcompile: need as many left as right operands");
  const size_t peers = order.size();
  check_lengths(peers, {peer_slots.size(), done_mine.size(), ready_theirs.size(), ready_mine.size(),
                        done_theirs.size()});
  if (push) check_lengths(peers, {stage_slots.size()});
  const auto device = As[0].device().index();
  c10::cuda::CUDAGuard guard(As[0].device());
  at::Tensor out = at::empty(out_shape, As[0].options());
  std::optional<c10::cuda::CUDAStream> side;
  if (push) side = external(side_handle, device);

  // Our partial of `owner`'s rows into dst.
  auto partial = [&](int64_t owner, const at::Tensor& dst) { matmul_rows(As, Bs, bias, owner * rows, rows, dst); };
  auto issue = [&] {
    const auto main = c10::cuda::getCurrentCUDAStream(device);
    if (push) {
      for (size_t j = 0; j < peers; ++j) {
        partial(order[j], stage_slots[j]);
        join(*side, main);
        send_block(*side, done_mine[j], peer_slots[j], stage_slots[j], ready_theirs[j]);
      }
    } else {
      for (size_t j = 0; j < peers; ++j) {
        consume_flag(main, done_mine[j]);
        partial(order[j], peer_slots[j]);  // zero-copy: cuBLAS stores into the peer's memory
        write_flag(main, ready_theirs[j], 1);
      }
    }
    partial(rank, own_slot);
    // With no peers the side stream did nothing (under a capture it never joined): nothing to wait for.
    reduce_and_release(main, peers ? side : std::nullopt, own_slot, own_slots, order, ready_mine, done_theirs, out,
                       rows);
  };
  replays().run(key_of(int64_t{kRsPipelined}, As, Bs, bias, peer_slots, stage_slots, own_slot, own_slots, order,
                       done_mine, ready_theirs, ready_mine, done_theirs, out, rank, rows, static_cast<int64_t>(push),
                       side_handle),
                graphs, device, issue);
  return out;
}

// GEMM -> reduce-scatter between two ranks, ":addmm" and ":pushadd": our block's GEMM adds the peer's partial
// of our rows (own_slots[order[0]]) in its epilogue (add_mm: C = that slot, D = the output), where
// rs_pipelined adds the two slots in a pass of its own after the GEMM. Lists as in rs_pipelined, of one peer.
//   :addmm (stage_slots empty):  the peer's block zero-copy; wait for the peer's partial; our block with it.
//   :pushadd:  the peer's block into staging, pushed by the copy engine on `side`; our first `split` rows into
//              our slot while the pushes fly; wait for the peer's partial; the other rows with it; then the
//              first rows' sum in a pass of their own (split of rows instead of all of them).
at::Tensor rs_addmm(const std::vector<at::Tensor>& As, const std::vector<at::Tensor>& Bs,
                    const std::optional<at::Tensor>& bias, std::vector<at::Tensor> peer_slots,
                    const std::vector<at::Tensor>& stage_slots, const at::Tensor& own_slot,
                    const at::Tensor& own_slots, const std::vector<int64_t>& order,
                    const std::vector<int64_t>& done_mine, const std::vector<int64_t>& ready_theirs,
                    const std::vector<int64_t>& ready_mine, const std::vector<int64_t>& done_theirs,
                    const std::vector<int64_t>& out_shape, int64_t rank, int64_t rows, int64_t split,
                    int64_t side_handle, int64_t graphs) {
  TORCH_CHECK(!As.empty() && As.size() == Bs.size(), "fluxcompile: need as many left as right operands");
  TORCH_CHECK(order.size() == 1, "fluxcompile: rs_addmm is for two ranks");
  check_lengths(1, {peer_slots.size(), done_mine.size(), ready_theirs.size(), ready_mine.size(), done_theirs.size()});
  const bool push = !stage_slots.empty();
  if (push) check_lengths(1, {stage_slots.size()});
  TORCH_CHECK(push ? 0 <= split && split < rows : split == 0, "fluxcompile: rs_addmm's split must be in [0, rows)");
  const auto device = As[0].device().index();
  c10::cuda::CUDAGuard guard(As[0].device());
  at::Tensor out = at::empty(out_shape, As[0].options());
  std::optional<c10::cuda::CUDAStream> side;
  if (push) side = external(side_handle, device);
  const at::Tensor theirs = own_slots.select(0, order[0]);

  auto issue = [&] {
    const auto main = c10::cuda::getCurrentCUDAStream(device);
    if (push) {
      matmul_rows(As, Bs, bias, order[0] * rows, rows, stage_slots[0]);
      join(*side, main);
      send_block(*side, done_mine[0], peer_slots[0], stage_slots[0], ready_theirs[0]);
      if (split > 0) matmul_rows(As, Bs, bias, rank * rows, split, own_slot.narrow(0, 0, split));
    } else {
      consume_flag(main, done_mine[0]);
      matmul_rows(As, Bs, bias, order[0] * rows, rows, peer_slots[0]);  // zero-copy into the peer's slot
      write_flag(main, ready_theirs[0], 1);
    }
    consume_flag(main, ready_mine[0]);
    at::Tensor out2 = out.view({rows, own_slots.size(2)});
    const int64_t lo = rank * rows + split, count = rows - split;
    at::Tensor dst = out2.narrow(0, split, count);
    add_mm(dst, theirs.narrow(0, split, count), As[0].narrow(0, lo, count), Bs[0], bias, main);
    for (size_t i = 1; i < As.size(); ++i) dst.addmm_(As[i].narrow(0, lo, count), Bs[i]);
    if (split > 0) {
      at::Tensor first = out2.narrow(0, 0, split);
      at::add_out(first, own_slot.narrow(0, 0, split), theirs.narrow(0, 0, split));  // fp32 math, one rounding
    }
    if (side.has_value()) join(main, *side);  // the next call's GEMM may overwrite the staging once pushed
    write_flag(main, done_theirs[0], 1);  // our slot is free again once it has been read
  };
  replays().run(key_of(int64_t{kRsAddmm}, As, Bs, bias, peer_slots, stage_slots, own_slot, own_slots, order,
                       done_mine, ready_theirs, ready_mine, done_theirs, out, rank, rows, split, side_handle),
                graphs, device, issue);
  return out;
}

// ---------------------------------------------------------------------------------------------
// all-gather -> GEMM (all_gather_matmul/cublas_pipelined.py). The send lists peer_slots (slot `rank` in a
// peer's buffer: our shard goes there), done_mine and ready_theirs run over the peers in the send order
// (exchange.gather_send_order); order, my_slots (slot order[j] in our buffer: its shard arrives there),
// ready_mine and done_theirs over the peers in ring order. compute_handles: one stream per peer (concurrent),
// or empty (main).
// Rows lo .. lo + a.size(0) of every output: a @ B_i (+ bias_i).
void mm_at(const at::Tensor& a, const std::vector<at::Tensor>& Bs, const std::vector<std::optional<at::Tensor>>& biases,
           std::vector<at::Tensor>& outs, int64_t lo) {
  for (size_t i = 0; i < Bs.size(); ++i) {
    at::Tensor dst = outs[i].narrow(0, lo, a.size(0));
    if (biases[i].has_value()) {
      at::addmm_out(dst, *biases[i], a, Bs[i]);
    } else {
      at::mm_out(dst, a, Bs[i]);
    }
  }
}

// One [m, N_i] output per weight.
std::vector<at::Tensor> empty_outs(const std::vector<at::Tensor>& Bs, int64_t m, const at::TensorOptions& options) {
  std::vector<at::Tensor> outs;
  outs.reserve(Bs.size());
  for (const auto& b : Bs) outs.push_back(at::empty({m, b.size(-1)}, options));
  return outs;
}

std::tuple<at::Tensor, std::vector<at::Tensor>> ag_pipelined(
    const at::Tensor& a_local, const std::vector<at::Tensor>& Bs,
    const std::vector<std::optional<at::Tensor>>& biases, const std::vector<int64_t>& gathered_shape,
    std::vector<at::Tensor> peer_slots, const std::vector<at::Tensor>& my_slots,
    const std::vector<int64_t>& order, const std::vector<int64_t>& done_mine,
    const std::vector<int64_t>& ready_theirs, const std::vector<int64_t>& ready_mine,
    const std::vector<int64_t>& done_theirs, int64_t rank, int64_t world, int64_t side_handle,
    const std::vector<int64_t>& compute_handles, int64_t graphs) {
  TORCH_CHECK(Bs.size() == biases.size(), "fluxcompile: one bias (or None) per weight");
  const size_t peers = order.size();
  check_lengths(peers, {peer_slots.size(), my_slots.size(), done_mine.size(), ready_theirs.size(),
                        ready_mine.size(), done_theirs.size()});
  const bool concurrent = !compute_handles.empty();
  if (concurrent) check_lengths(peers, {compute_handles.size()});
  const auto device = a_local.device().index();
  c10::cuda::CUDAGuard guard(a_local.device());
  const auto side = external(side_handle, device);
  const int64_t rows = a_local.size(0), k = a_local.size(1);
  std::vector<c10::cuda::CUDAStream> gemm_streams;  // concurrent: one per peer
  for (int64_t h : compute_handles) gemm_streams.push_back(external(h, device));

  at::Tensor gathered = at::empty(gathered_shape, a_local.options());
  at::Tensor rows_of = gathered.view({world, rows, k});  // rank i's rows (no leading dims before the gather dim)
  std::vector<at::Tensor> outs = empty_outs(Bs, world * rows, a_local.options());

  const auto gemms = gemm_stream(device);
  std::vector<c10::cuda::CUDAStream> with_gemms = gemm_streams;  // their cuBLAS workspaces before a capture
  with_gemms.push_back(gemms);
  auto sequence = [&](const c10::cuda::CUDAStream& main) {
    push_shard(side, main, a_local, peer_slots, done_mine, ready_theirs, rows_of, rank);

    std::vector<c10::cuda::CUDAStream> compute;
    compute.reserve(peers);
    for (size_t j = 0; j < peers; ++j) compute.push_back(concurrent ? gemm_streams[j] : main);
    if (concurrent) {
      for (const auto& s : compute) join(s, main);  // A, the outputs and the flag resets are ready
    }
    mm_at(a_local, Bs, biases, outs, rank * rows);
    for (size_t j = 0; j < peers; ++j) {
      const auto& s = compute[j];
      c10::cuda::CUDAStreamGuard on_s(s);
      consume_flag(s, ready_mine[j]);
      join(side, s);
      mm_at(my_slots[j], Bs, biases, outs, order[j] * rows);
      // After the GEMM's launch: the copy fills the SMs the GEMM leaves rather than delay its start.
      copy_async(rows_of.select(0, order[j]), my_slots[j], side);
    }
    if (concurrent) {
      for (const auto& s : compute) join(main, s);
    }
    join(main, side);
    for (size_t j = 0; j < peers; ++j) write_flag(main, done_theirs[j], 1);
  };
  auto issue = [&] { on_gemm_stream(gemms, sequence); };
  replays().run(key_of(int64_t{kAgPipelined}, a_local, Bs, biases, peer_slots, my_slots, order, done_mine,
                       ready_theirs, ready_mine, done_theirs, rank, world, side_handle, compute_handles, gathered,
                       outs),
                graphs, device, issue, with_gemms);
  return {gathered, outs};
}

// ---------------------------------------------------------------------------------------------
// The unsplit variants (":unsplit" choices): one GEMM over all rows, then the exchange by the copy engine.
// No overlap, but no GEMM split by rank either (at small m a split costs up to a wave per block) and the
// fewest launches (host time); the copy engine moves a block over NVLink faster than NCCL's kernels at
// these sizes. The autotuner keeps them where they are faster.

// GEMM -> reduce-scatter: P (our [m, n] partial, a local region of the symmetric buffer) in one GEMM;
// the side stream pushes each peer's block of P into its slot; we add the peers' partials of our rows.
// With `tail` > 0 (":tail<d>" choices), `tail` of our own rows are left out of that GEMM and computed while
// the copy engine pushes the peers' blocks, which the first GEMM has finished (unsplit leaves the pushes
// bare). The tail rows are the first of ours, or the last for the last rank, so that the first GEMM's rows
// are one or two contiguous ranges.
at::Tensor rs_tail(const std::vector<at::Tensor>& As, const std::vector<at::Tensor>& Bs,
                   const std::optional<at::Tensor>& bias, const at::Tensor& stage_all,
                   std::vector<at::Tensor> peer_slots, const at::Tensor& own_slot, const at::Tensor& own_slots,
                   const std::vector<int64_t>& order, const std::vector<int64_t>& done_mine,
                   const std::vector<int64_t>& ready_theirs, const std::vector<int64_t>& ready_mine,
                   const std::vector<int64_t>& done_theirs, const std::vector<int64_t>& out_shape, int64_t rank,
                   int64_t rows, int64_t tail, int64_t side_handle, int64_t graphs) {
  TORCH_CHECK(!As.empty() && As.size() == Bs.size(), "fluxcompile: need as many left as right operands");
  TORCH_CHECK(0 <= tail && tail < rows, "fluxcompile: tail must be in [0, rows)");
  const size_t peers = order.size();
  check_lengths(peers, {peer_slots.size(), done_mine.size(), ready_theirs.size(), ready_mine.size(),
                        done_theirs.size()});
  const auto device = As[0].device().index();
  c10::cuda::CUDAGuard guard(As[0].device());
  const auto side = external(side_handle, device);
  const int64_t m = stage_all.size(0), world = static_cast<int64_t>(peers) + 1;
  const int64_t lo = rank * rows + (rank == world - 1 ? rows - tail : 0), hi = lo + tail;
  at::Tensor out = at::empty(out_shape, stage_all.options());

  auto issue = [&] {
    const auto main = c10::cuda::getCurrentCUDAStream(device);
    if (tail == 0) {
      matmul_rows(As, Bs, bias, 0, m, stage_all);
    } else {
      if (lo > 0) matmul_rows(As, Bs, bias, 0, lo, stage_all.narrow(0, 0, lo));
      if (hi < m) matmul_rows(As, Bs, bias, hi, m - hi, stage_all.narrow(0, hi, m - hi));
    }
    join(side, main);
    for (size_t j = 0; j < peers; ++j) {
      send_block(side, done_mine[j], peer_slots[j], stage_all.narrow(0, order[j] * rows, rows), ready_theirs[j]);
    }
    if (tail > 0) matmul_rows(As, Bs, bias, lo, tail, stage_all.narrow(0, lo, tail));  // beside the pushes
    const at::Tensor mine = stage_all.narrow(0, rank * rows, rows);
    if (own_slots.size(0) > 2) copy_async(own_slot, mine, main);  // so one sum covers every source
    // Joining `side` also lets the next call's GEMM overwrite P only once our pushes have read it.
    reduce_and_release(main, side, mine, own_slots, order, ready_mine, done_theirs, out, rows);
  };
  replays().run(key_of(int64_t{kRsTail}, As, Bs, bias, stage_all, peer_slots, own_slot, own_slots, order, done_mine,
                       ready_theirs, ready_mine, done_theirs, out, rank, rows, tail, side_handle),
                graphs, device, issue);
  return out;
}

// all-gather -> GEMM: the side stream pushes our shard into every peer's slot and assembles the gathered
// A (ours from A, each peer's from its slot once it landed); then one GEMM per weight over all rows.
std::tuple<at::Tensor, std::vector<at::Tensor>> ag_unsplit(
    const at::Tensor& a_local, const std::vector<at::Tensor>& Bs,
    const std::vector<std::optional<at::Tensor>>& biases, const std::vector<int64_t>& gathered_shape,
    std::vector<at::Tensor> peer_slots, const std::vector<at::Tensor>& my_slots, const std::vector<int64_t>& order,
    const std::vector<int64_t>& done_mine, const std::vector<int64_t>& ready_theirs,
    const std::vector<int64_t>& ready_mine, const std::vector<int64_t>& done_theirs, int64_t rank, int64_t world,
    int64_t side_handle, int64_t graphs) {
  TORCH_CHECK(Bs.size() == biases.size(), "fluxcompile: one bias (or None) per weight");
  const size_t peers = order.size();
  check_lengths(peers, {peer_slots.size(), my_slots.size(), done_mine.size(), ready_theirs.size(),
                        ready_mine.size(), done_theirs.size()});
  const auto device = a_local.device().index();
  c10::cuda::CUDAGuard guard(a_local.device());
  const auto side = external(side_handle, device);
  const int64_t rows = a_local.size(0), k = a_local.size(1);

  at::Tensor gathered = at::empty(gathered_shape, a_local.options());
  at::Tensor rows_of = gathered.view({world, rows, k});
  std::vector<at::Tensor> outs = empty_outs(Bs, world * rows, a_local.options());
  auto issue = [&] {
    const auto main = c10::cuda::getCurrentCUDAStream(device);
    push_shard(side, main, a_local, peer_slots, done_mine, ready_theirs, rows_of, rank);
    for (size_t j = 0; j < peers; ++j) {
      consume_flag(side, ready_mine[j]);
      copy_async(rows_of.select(0, order[j]), my_slots[j], side);
    }
    for (size_t j = 0; j < peers; ++j) write_flag(side, done_theirs[j], 1);  // our slots are free again
    join(main, side);
    mm_at(gathered.view({world * rows, k}), Bs, biases, outs, 0);
  };
  replays().run(key_of(int64_t{kAgUnsplit}, a_local, Bs, biases, peer_slots, my_slots, order, done_mine,
                       ready_theirs, ready_mine, done_theirs, rank, world, side_handle, gathered, outs),
                graphs, device, issue);
  return {gathered, outs};
}

// ---------------------------------------------------------------------------------------------
// all-gather -> GEMM, "lead" (":lead<d>" choices): a first GEMM over `lead` of our own rows hides the
// shards' flight; then one GEMM (two for a rank in the middle of the order) over every other row, read
// from our symmetric buffer, where the slots by source rank form the gathered [world * rows, k] (our other
// rows are copied into our slot on `aux` beside the lead GEMM). Two or three GEMMs instead of one per rank:
// a split costs up to a wave per GEMM, and `lead` can be picked (by the autotuner) so that the two add no
// wave.
// The lead rows are the first of ours, or the last for the last rank, so that the rest is contiguous.
//   buffer: our whole symmetric buffer as [world * rows, k] (slot s = rows s * rows ..)
std::tuple<at::Tensor, std::vector<at::Tensor>> ag_lead(
    const at::Tensor& a_local, const std::vector<at::Tensor>& Bs,
    const std::vector<std::optional<at::Tensor>>& biases, const std::vector<int64_t>& gathered_shape,
    std::vector<at::Tensor> peer_slots, const at::Tensor& buffer, const std::vector<int64_t>& order,
    const std::vector<int64_t>& done_mine, const std::vector<int64_t>& ready_theirs,
    const std::vector<int64_t>& ready_mine, const std::vector<int64_t>& done_theirs, int64_t rank, int64_t world,
    int64_t lead, int64_t side_handle, int64_t aux_handle, int64_t graphs) {
  TORCH_CHECK(Bs.size() == biases.size(), "fluxcompile: one bias (or None) per weight");
  const size_t peers = order.size();
  check_lengths(peers, {peer_slots.size(), done_mine.size(), ready_theirs.size(), ready_mine.size(),
                        done_theirs.size()});
  const auto device = a_local.device().index();
  c10::cuda::CUDAGuard guard(a_local.device());
  const auto side = external(side_handle, device);
  const auto aux = external(aux_handle, device);
  const int64_t rows = a_local.size(0), k = a_local.size(1), m = world * rows;
  TORCH_CHECK(0 < lead && lead < rows, "fluxcompile: lead must be in (0, rows)");
  TORCH_CHECK(buffer.size(0) == m && buffer.size(1) == k, "fluxcompile: the buffer must be [world * rows, k]");

  at::Tensor gathered = at::empty(gathered_shape, a_local.options());
  at::Tensor rows_of = gathered.view({world, rows, k});
  std::vector<at::Tensor> outs = empty_outs(Bs, m, a_local.options());
  auto gemm = [&](const at::Tensor& a, int64_t lo) { mm_at(a, Bs, biases, outs, lo); };

  const auto gemms = gemm_stream(device);
  auto sequence = [&](const c10::cuda::CUDAStream& main) {
    // Side: the pushes (the peers wait for them). Main: the lead GEMM, which reads A itself. Aux: our other
    // rows into our own slot, issued after the lead GEMM so that the copy (an SM copy) takes the SMs the
    // lead GEMM leaves free rather than delaying its start; not queued behind the pushes on the side
    // stream, or the rest GEMM would wait for those too.
    push_shard(side, main, a_local, peer_slots, done_mine, ready_theirs, rows_of, rank);
    join(aux, main);

    const bool last = rank == world - 1;
    const int64_t lead_lo = last ? rows - lead : 0;  // within our rows
    const int64_t other_lo = last ? 0 : lead;  // our rows the lead leaves out
    gemm(a_local.narrow(0, lead_lo, lead), rank * rows + lead_lo);
    copy_async(buffer.narrow(0, rank * rows + other_lo, rows - lead), a_local.narrow(0, other_lo, rows - lead), aux);
    for (size_t j = 0; j < peers; ++j) consume_flag(main, ready_mine[j]);
    join(main, aux);
    // The rest: [0, lo) and [hi, m) of the gathered rows. The gathered output's peer rows: SM copies on the
    // side stream after the ready waits, beside the rest GEMM (which need not wait for them, nor for our
    // pushes), issued after it so that they fill the SMs its last wave leaves rather than delay its start.
    join(side, main);
    const int64_t lo = rank * rows + lead_lo, hi = lo + lead;
    if (lo > 0) gemm(buffer.narrow(0, 0, lo), 0);
    if (hi < m) gemm(buffer.narrow(0, hi, m - hi), hi);
    for (size_t j = 0; j < peers; ++j) {
      copy_async(rows_of.select(0, order[j]), buffer.narrow(0, order[j] * rows, rows), side);
    }
    join(main, side);  // then our slots are free again
    for (size_t j = 0; j < peers; ++j) write_flag(main, done_theirs[j], 1);
  };
  auto issue = [&] { on_gemm_stream(gemms, sequence); };
  replays().run(key_of(int64_t{kAgLead}, a_local, Bs, biases, peer_slots, buffer, order, done_mine, ready_theirs,
                       ready_mine, done_theirs, rank, world, lead, side_handle, aux_handle, gathered, outs),
                graphs, device, issue, {gemms});
  return {gathered, outs};
}

// The groups of the ":stages" choices: every peer's flag is taken exactly once per call (a stale 1 would pass
// the next call's wait), and every range is rows lo < hi within [0, m). Checked before any stream operation.
void check_groups(size_t peers, int64_t m, const std::vector<std::vector<int64_t>>& group_js,
                  const std::vector<std::vector<int64_t>>& group_ranges) {
  TORCH_CHECK(group_js.size() == group_ranges.size(), "fluxcompile: one range list per group");
  std::vector<int> seen(peers, 0);
  for (const auto& js : group_js) {
    for (int64_t j : js) {
      TORCH_CHECK(0 <= j && j < static_cast<int64_t>(peers), "fluxcompile: a group names no peer");
      ++seen[j];
    }
  }
  for (int c : seen) TORCH_CHECK(c == 1, "fluxcompile: the groups must take every peer exactly once");
  for (const auto& rs : group_ranges) {
    TORCH_CHECK(rs.size() % 2 == 0, "fluxcompile: ranges come as lo, hi pairs");
    for (size_t i = 0; i < rs.size(); i += 2) {
      TORCH_CHECK(0 <= rs[i] && rs[i] < rs[i + 1] && rs[i + 1] <= m, "fluxcompile: a row range out of bounds");
    }
  }
}

// all-gather -> GEMM, ":stages<g>" (all_gather_matmul/cublas_pipelined.py): the peers' shards in groups, one
// GEMM per group's row range(s) of our symmetric buffer (its slots abut into the gathered [world * rows, k]),
// after a GEMM over our own rows from A. group_js[g]: indices j of the group's peers (their ready flags);
// group_ranges[g]: its row ranges, flattened [lo0, hi0, lo1, hi1, ...].
std::tuple<at::Tensor, std::vector<at::Tensor>> ag_stages(
    const at::Tensor& a_local, const std::vector<at::Tensor>& Bs,
    const std::vector<std::optional<at::Tensor>>& biases, const std::vector<int64_t>& gathered_shape,
    std::vector<at::Tensor> peer_slots, const at::Tensor& buffer, const std::vector<int64_t>& order,
    const std::vector<int64_t>& done_mine, const std::vector<int64_t>& ready_theirs,
    const std::vector<int64_t>& ready_mine, const std::vector<int64_t>& done_theirs, int64_t rank, int64_t world,
    const std::vector<std::vector<int64_t>>& group_js, const std::vector<std::vector<int64_t>>& group_ranges,
    int64_t side_handle, int64_t graphs) {
  TORCH_CHECK(Bs.size() == biases.size(), "fluxcompile: one bias (or None) per weight");
  const size_t peers = order.size();
  check_lengths(peers, {peer_slots.size(), done_mine.size(), ready_theirs.size(), ready_mine.size(),
                        done_theirs.size()});
  check_groups(peers, world * a_local.size(0), group_js, group_ranges);
  const auto device = a_local.device().index();
  c10::cuda::CUDAGuard guard(a_local.device());
  const auto side = external(side_handle, device);
  const int64_t rows = a_local.size(0), k = a_local.size(1), m = world * rows;
  TORCH_CHECK(buffer.size(0) == m && buffer.size(1) == k, "fluxcompile: the buffer must be [world * rows, k]");

  at::Tensor gathered = at::empty(gathered_shape, a_local.options());
  at::Tensor all_rows = gathered.view({m, k});
  std::vector<at::Tensor> outs = empty_outs(Bs, m, a_local.options());
  auto gemm = [&](const at::Tensor& a, int64_t lo) { mm_at(a, Bs, biases, outs, lo); };

  const auto gemms = gemm_stream(device);
  auto sequence = [&](const c10::cuda::CUDAStream& main) {
    push_shard(side, main, a_local, peer_slots, done_mine, ready_theirs, gathered.view({world, rows, k}), rank);
    gemm(a_local, rank * rows);
    for (size_t g = 0; g < group_js.size(); ++g) {
      const auto& rs = group_ranges[g];
      for (int64_t j : group_js[g]) consume_flag(main, ready_mine[j]);
      join(side, main);  // the group's rows have landed: the gathered output's copies, beside its GEMMs
      for (size_t i = 0; i < rs.size(); i += 2) {
        copy_async(all_rows.narrow(0, rs[i], rs[i + 1] - rs[i]), buffer.narrow(0, rs[i], rs[i + 1] - rs[i]), side);
      }
      for (size_t i = 0; i < rs.size(); i += 2) gemm(buffer.narrow(0, rs[i], rs[i + 1] - rs[i]), rs[i]);
    }
    join(main, side);  // then our slots are free again
    for (size_t j = 0; j < peers; ++j) write_flag(main, done_theirs[j], 1);
  };
  auto issue = [&] { on_gemm_stream(gemms, sequence); };
  replays().run(key_of(int64_t{kAgStages}, a_local, Bs, biases, peer_slots, buffer, order, done_mine, ready_theirs,
                       ready_mine, done_theirs, rank, world, group_js, group_ranges, side_handle, gathered, outs),
                graphs, device, issue, {gemms});
  return {gathered, outs};
}

// GEMM -> reduce-scatter, ":stages<g>" (matmul_reduce_scatter/cublas_pipelined.py): the peers' row blocks in
// groups, one GEMM per group's row range(s) into our local partial P (stage_all), each group's blocks pushed
// by the copy engine as soon as its GEMM is done, beside the next group's GEMM; our own block last, then the
// owner's sum.
at::Tensor rs_stages(const std::vector<at::Tensor>& As, const std::vector<at::Tensor>& Bs,
                     const std::optional<at::Tensor>& bias, const at::Tensor& stage_all,
                     std::vector<at::Tensor> peer_slots, const at::Tensor& own_slot, const at::Tensor& own_slots,
                     const std::vector<int64_t>& order, const std::vector<int64_t>& done_mine,
                     const std::vector<int64_t>& ready_theirs, const std::vector<int64_t>& ready_mine,
                     const std::vector<int64_t>& done_theirs, const std::vector<int64_t>& out_shape, int64_t rank,
                     int64_t rows, const std::vector<std::vector<int64_t>>& group_js,
                     const std::vector<std::vector<int64_t>>& group_ranges, int64_t side_handle, int64_t graphs) {
  TORCH_CHECK(!As.empty() && As.size() == Bs.size(), "fluxcompile: need as many left as right operands");
  const size_t peers = order.size();
  check_lengths(peers, {peer_slots.size(), done_mine.size(), ready_theirs.size(), ready_mine.size(),
                        done_theirs.size()});
  check_groups(peers, stage_all.size(0), group_js, group_ranges);
  const auto device = As[0].device().index();
  c10::cuda::CUDAGuard guard(As[0].device());
  const auto side = external(side_handle, device);
  at::Tensor out = at::empty(out_shape, stage_all.options());

  auto issue = [&] {
    const auto main = c10::cuda::getCurrentCUDAStream(device);
    for (size_t g = 0; g < group_js.size(); ++g) {
      const auto& rs = group_ranges[g];
      for (size_t i = 0; i < rs.size(); i += 2) {
        matmul_rows(As, Bs, bias, rs[i], rs[i + 1] - rs[i], stage_all.narrow(0, rs[i], rs[i + 1] - rs[i]));
      }
      join(side, main);
      for (int64_t j : group_js[g]) {
        send_block(side, done_mine[j], peer_slots[j], stage_all.narrow(0, order[j] * rows, rows), ready_theirs[j]);
      }
    }
    // Our own block: straight into our slot where the sum reads every slot (> 2 ranks), else into P.
    const bool two = own_slots.size(0) == 2;
    const at::Tensor mine = two ? stage_all.narrow(0, rank * rows, rows) : own_slot;
    matmul_rows(As, Bs, bias, rank * rows, rows, mine);
    const auto pushed = peers ? std::optional<c10::cuda::CUDAStream>(side) : std::nullopt;  // see rs_pipelined
    reduce_and_release(main, pushed, mine, own_slots, order, ready_mine, done_theirs, out, rows);
  };
  replays().run(key_of(int64_t{kRsStages}, As, Bs, bias, stage_all, peer_slots, own_slot, own_slots, order,
                       done_mine, ready_theirs, ready_mine, done_theirs, out, rank, rows, group_js, group_ranges,
                       side_handle),
                graphs, device, issue);
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rs_pipelined", &rs_pipelined, "GEMM -> reduce-scatter, cuBLAS-pipelined");
  m.def("rs_addmm", &rs_addmm, "GEMM -> reduce-scatter at two ranks: the peer's partial added in our GEMM's epilogue");
  m.def("lt_available", &lt_available, "whether add_mm finds cuBLASLt (else it copies C into D first)");
  m.def("ag_pipelined", &ag_pipelined, "all-gather -> GEMM, cuBLAS-pipelined");
  m.def("rs_stages", &rs_stages, "GEMM -> reduce-scatter: one GEMM per group of peers, then our own block");
  m.def("rs_tail", &rs_tail,
        "GEMM -> reduce-scatter: all rows but a tail of ours (none: unsplit), then the tail beside the pushes");
  m.def("ag_unsplit", &ag_unsplit, "all-gather by the copy engine, then one GEMM per weight");
  m.def("ag_stages", &ag_stages, "all-gather -> GEMM: our rows, then one GEMM per group of peers");
  m.def("ag_lead", &ag_lead, "all-gather -> GEMM: a lead GEMM over some of our rows, then the rest in one");
  m.def("replay_stats", [] { return replays().stats(); },
        "[replays, captures, direct calls, failed captures, graphs held] since the last clear");
  m.def("clear_replays", [] { replays().clear(); }, "drop every captured sequence (tests; stale workspaces)");
  m.def("capture_failure", [] { return replays().last_failure(); },
        "why the last failed capture since the last clear failed (empty: none failed)");
}
