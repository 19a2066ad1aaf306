// Replays of the `pipelined` module's sequences as CUDA graphs (replays.cpp holds the parts that are no templates).
//
// A sequence (sequences_ag.cpp, sequences_rs.cpp) is a pure function of its arguments: the same pointers, shapes, flag addresses
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
#pragma once

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

namespace fluxcompile::pipelined {

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
  // one that issue() runs GEMMs on. blas: whether issue() runs cuBLAS (whose handles and workspaces are made
  // before a capture); a sequence without cuBLAS makes none.
  template <class F>
  void run(std::vector<int64_t> key, int64_t limit, c10::DeviceIndex device, F&& issue,
           const std::vector<c10::cuda::CUDAStream>& gemm_streams = {}, bool blas = true) {
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
    std::unique_ptr<Graph> graph = capture(device, issue, gemm_streams, blas, why);
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
                                 const std::vector<c10::cuda::CUDAStream>& gemm_streams, bool blas, std::string& why) {
    const auto cs = capture_stream(device);
    if (blas) {
      warm_blas(cs);  // before the count: they may allocate
      for (const auto& s : gemm_streams) warm_blas(s);
    }
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

  static int64_t blas_settings();
  // How many blocks, and bytes, the caching allocator has handed out on `device`, ever.
  struct Handed {
    int64_t blocks = 0, bytes = 0;
  };
  static bool handed_out(c10::DeviceIndex device, Handed& h);  // false if it cannot say
  static std::string error_text(cudaError_t rc);
  template <class F>
  void direct(F&& issue) {
    ++stats_.direct;
    issue();
  }
  static bool capturing(const c10::cuda::CUDAStream& s);
  bool first_sight(const std::vector<int64_t>& key);
  static c10::cuda::CUDAStream capture_stream(c10::DeviceIndex device);
  static void warm_blas(const c10::cuda::CUDAStream& s);

  std::unordered_map<std::vector<int64_t>, std::unique_ptr<Graph>, KeyHash> graphs_;
  std::unordered_map<std::vector<int64_t>, bool, KeyHash> seen_, refused_;
  ReplayStats stats_;
  std::string last_failure_;
};

// The process's replays (every sequence's).
Replays& replays();

}  // namespace fluxcompile::pipelined
