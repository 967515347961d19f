// hwhooks: a CPU collective backend that keeps ProcessGroupNCCL2's contract
// with torch's FlightRecorderHook (torch >= 2.15), so the tests can exercise
// the path 2.15's default `nccl` takes without a GPU.
//
// What it keeps of NCCL2, as torch's hooks see it:
// * asynchronous work: a call enqueues the op on a worker thread (the
//   "stream") and returns a Work at once;
// * completion hooks: fired once per Work when the op really finished, with
//   the backend's own duration; failed or timed-out work fires none;
// * abort hooks: a watchdog fails work past its timeout, runs the abort hooks
//   first (torch's hook writes <TORCH_FR_DUMP_TEMP_FILE><rank> from them,
//   HealthCheckHook marks the backend unhealthy), then fails every pending
//   Work with a DistBackendError, as NCCL's watchdog does;
// * after a peer's abort the group's communicator is gone: a rank that arrives
//   at a collective its peers abandoned never completes it (it times out in
//   its turn), and so does everything after it;
// * it does not record itself: torch attaches its FlightRecorderHook.
//
// Data moves through the job's c10d store (each group gets its own prefix),
// never through gloo, so nothing lands in the gloo recorder instance.
// Collectives match across ranks by their group-local sequence number, so a
// rank that skips one leaves its peers blocked, as on a real network.

#include <torch/extension.h>

#include <pybind11/chrono.h>

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Hooks.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <iostream>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace hwhooks {

using Clock = std::chrono::steady_clock;
using Bytes = std::vector<uint8_t>;
using c10::intrusive_ptr;

const std::string kName = "hwhooks";

// Completion keys must never repeat in a process: a completion can outlive
// its Work (Work.hpp), so the hook must not confuse two of them.
std::atomic<uint64_t> nextCompletionKey{1};

// Thrown inside the worker when the group was aborted under it.
struct Aborted {};

std::exception_ptr backendError(const std::string& why) {
  // DistBackendError reaches Python as torch.distributed.DistBackendError,
  // which is what NCCL's watchdog raises in the caller.
  return std::make_exception_ptr(c10::DistBackendError(
      c10::SourceLocation{__func__, __FILE__, static_cast<uint32_t>(__LINE__)}, why));
}

class HwWork : public c10d::Work {
 public:
  HwWork(int rank, c10d::OpType type, std::vector<at::Tensor> outputs)
      : c10d::Work(rank, type),
        outputs_(std::move(outputs)),
        key_(nextCompletionKey.fetch_add(1)),
        future_(c10::make_intrusive<at::ivalue::Future>(
            c10::ListType::create(c10::TensorType::get()))) {}

  uint64_t getCompletionKey() const override {
    return key_;
  }
  float getDuration() const override {
    return durationMs_.load();
  }
  std::vector<at::Tensor> result() override {
    return outputs_;
  }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    return future_;
  }

  // Both return false when the work had already ended (a failed Work is
  // failed once, whoever gets there first: the watchdog or the worker).
  bool succeed(float ms) {
    if (ended_.exchange(true)) {
      return false;
    }
    durationMs_ = ms;
    finish();
    future_->markCompleted(c10::IValue(outputs_));
    return true;
  }
  bool fail(const std::exception_ptr& e) {
    if (ended_.exchange(true)) {
      return false;
    }
    finish(e);
    future_->setError(e);
    return true;
  }
  bool ended() const {
    return ended_.load();
  }

 private:
  std::vector<at::Tensor> outputs_;
  const uint64_t key_;
  std::atomic<float> durationMs_{-1.0f};
  std::atomic<bool> ended_{false};
  c10::intrusive_ptr<at::ivalue::Future> future_;
};

struct Op {
  intrusive_ptr<HwWork> work;
  std::string what; // "all_reduce #12": for the timeout message
  std::chrono::milliseconds timeout;
  Clock::time_point enqueued;
  bool isSend = false;
  std::function<void()> run; // blocks until done; throws Aborted
};

class HwBackend : public c10d::Backend {
 public:
  HwBackend(
      const intrusive_ptr<c10d::Store>& store,
      int rank,
      int size,
      std::chrono::milliseconds timeout)
      : c10d::Backend(rank, size),
        // The worker polls the store; a connection of its own keeps those
        // polls from queueing behind the caller's store traffic.
        store_(store->clone()),
        ctlStore_(store),
        timeout_(timeout),
        options_(c10::make_intrusive<Options>(kName, timeout)) {
    worker_ = std::thread([this] { workLoop(); });
    watchdog_ = std::thread([this] { watchdogLoop(); });
  }

  ~HwBackend() override {
    shutdown();
    // An abort hook registered from Python holds a Python callable, and a
    // backend dropped at interpreter exit is destroyed without the GIL:
    // destroying the callable then aborts the process ("PyThreadState_Get:
    // the function must be called with the GIL held", measured). The hooks
    // are a few closures per group; they live as long as the process.
    std::lock_guard<std::mutex> g(hookMu_);
    new std::map<int64_t, c10d::AbortHook>(std::move(abortHooks_));
    new std::map<int64_t, c10d::CompletionHook>(std::move(completionHooks_));
  }

  const std::string getBackendName() const override {
    return kName;
  }
  c10::intrusive_ptr<Options> getBackendOptions() override {
    return options_;
  }
  void setTimeout(std::chrono::milliseconds timeout) override {
    timeout_ = timeout;
    options_->timeout = timeout;
  }

  // --- hooks -------------------------------------------------------------

  bool supportsCompletionHooks() const override {
    return true;
  }
  void registerCompletionHook(int64_t id, c10d::CompletionHook hook) override {
    std::lock_guard<std::mutex> g(hookMu_);
    completionHooks_[id] = std::move(hook);
  }
  void unregisterCompletionHook(int64_t id) override {
    std::lock_guard<std::mutex> g(hookMu_);
    completionHooks_.erase(id);
  }
  bool supportsAbortHooks() const override {
    return true;
  }
  void registerAbortHook(int64_t id, c10d::AbortHook hook) override {
    std::lock_guard<std::mutex> g(hookMu_);
    abortHooks_[id] = std::move(hook);
  }
  void unregisterAbortHook(int64_t id) override {
    std::lock_guard<std::mutex> g(hookMu_);
    abortHooks_.erase(id);
  }

  // --- collectives ------------------------------------------------------

  intrusive_ptr<c10d::Work> allreduce(
      std::vector<at::Tensor>& tensors,
      const c10d::AllreduceOptions& opts) override {
    return reduceAll(tensors, opts.reduceOp, opts.timeout, "all_reduce");
  }

  intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors,
      const c10d::AllreduceCoalescedOptions& opts) override {
    return reduceAll(tensors, opts.reduceOp, opts.timeout, "allreduce_coalesced");
  }

  intrusive_ptr<c10d::Work> broadcast(
      std::vector<at::Tensor>& tensors,
      const c10d::BroadcastOptions& opts) override {
    const int root = static_cast<int>(opts.rootRank);
    auto ts = tensors;
    return collective(
        c10d::OpType::BROADCAST, "broadcast", ts, opts.timeout,
        rank_ == root ? pack(ts) : Bytes{},
        [this, ts, root](std::vector<Bytes>& parts) mutable {
          if (rank_ != root) {
            unpack(parts[root], ts);
          }
        });
  }

  intrusive_ptr<c10d::Work> allgather(
      std::vector<std::vector<at::Tensor>>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override {
    TORCH_CHECK(outputs.size() == 1 && inputs.size() == 1, kName, ": one tensor per rank");
    auto outs = outputs[0];
    TORCH_CHECK(static_cast<int>(outs.size()) == size_, kName, ": all_gather needs world outputs");
    return collective(
        c10d::OpType::ALLGATHER, "all_gather", outs, opts.timeout, pack(inputs),
        [outs](std::vector<Bytes>& parts) mutable {
          for (size_t r = 0; r < parts.size(); ++r) {
            std::vector<at::Tensor> one{outs[r]};
            unpack(parts[r], one);
          }
        });
  }

  intrusive_ptr<c10d::Work> _allgather_base(
      at::Tensor& output,
      at::Tensor& input,
      const c10d::AllgatherOptions& opts) override {
    std::vector<at::Tensor> outs{output}, ins{input};
    return allgatherInto(outs, ins, opts, "all_gather_into_tensor");
  }
  intrusive_ptr<c10d::Work> all_gather_single(
      at::Tensor& output,
      at::Tensor& input,
      const c10d::AllgatherOptions& opts) override {
    return _allgather_base(output, input, opts);
  }
  intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(
      std::vector<at::Tensor>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override {
    return allgatherInto(outputs, inputs, opts, "allgather_into_tensor_coalesced");
  }
  intrusive_ptr<c10d::Work> all_gather_single_coalesced(
      std::vector<at::Tensor>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override {
    return allgather_into_tensor_coalesced(outputs, inputs, opts);
  }

  intrusive_ptr<c10d::Work> reduce_scatter(
      std::vector<at::Tensor>& outputs,
      std::vector<std::vector<at::Tensor>>& inputs,
      const c10d::ReduceScatterOptions& opts) override {
    TORCH_CHECK(outputs.size() == 1 && inputs.size() == 1, kName, ": one tensor per rank");
    // Each rank sends its whole input list; rank r reduces everyone's part r.
    std::vector<at::Tensor> flat;
    for (auto& t : inputs[0]) {
      flat.push_back(t.contiguous().reshape({-1}));
    }
    auto whole = at::cat(flat);
    auto out = outputs[0];
    return reduceScatterInto({out}, {whole}, opts, "reduce_scatter");
  }
  intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& output,
      at::Tensor& input,
      const c10d::ReduceScatterOptions& opts) override {
    return reduceScatterInto({output}, {input}, opts, "reduce_scatter_tensor");
  }
  intrusive_ptr<c10d::Work> reduce_scatter_single(
      at::Tensor& output,
      at::Tensor& input,
      const c10d::ReduceScatterOptions& opts) override {
    return _reduce_scatter_base(output, input, opts);
  }
  intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(
      std::vector<at::Tensor>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::ReduceScatterOptions& opts) override {
    return reduceScatterInto(outputs, inputs, opts, "reduce_scatter_tensor_coalesced");
  }
  intrusive_ptr<c10d::Work> reduce_scatter_single_coalesced(
      std::vector<at::Tensor>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::ReduceScatterOptions& opts) override {
    return reduce_scatter_tensor_coalesced(outputs, inputs, opts);
  }

  intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override {
    std::vector<at::Tensor> none;
    return collective(
        c10d::OpType::BARRIER, "barrier", none, opts.timeout, Bytes{1},
        [](std::vector<Bytes>&) {});
  }

  // --- point to point ----------------------------------------------------

  intrusive_ptr<c10d::Work> send(
      std::vector<at::Tensor>& tensors,
      int dst,
      int /* tag */) override {
    const std::string key = p2pKey(rank_, dst);
    Bytes data = pack(tensors);
    auto work = c10::make_intrusive<HwWork>(rank_, c10d::OpType::SEND, tensors);
    Op op{work, "send to " + std::to_string(dst), timeout_, Clock::now(), true,
          [this, key, data]() { store_->set(key, data); }};
    return enqueue(std::move(op));
  }

  intrusive_ptr<c10d::Work> recv(
      std::vector<at::Tensor>& tensors,
      int src,
      int /* tag */) override {
    const std::string key = p2pKey(src, rank_);
    auto ts = tensors;
    auto work = c10::make_intrusive<HwWork>(rank_, c10d::OpType::RECV, tensors);
    Op op{work, "recv from " + std::to_string(src), timeout_, Clock::now(), false,
          [this, key, ts]() mutable {
            waitKeys({key});
            Bytes data = store_->get(key);
            store_->deleteKey(key);
            unpack(data, ts);
          }};
    return enqueue(std::move(op));
  }

  // --- coalescing (batch_isend_irecv, _coalescing_manager) ---------------

  bool supportsCoalescing() const override {
    return true;
  }
  void startCoalescing() override {
    std::lock_guard<std::mutex> g(mu_);
    coalescing_ = true;
  }
  intrusive_ptr<c10d::Work> endCoalescing() override {
    std::vector<Op> batch;
    {
      std::lock_guard<std::mutex> g(mu_);
      coalescing_ = false;
      batch.swap(coalesced_);
    }
    // A batch is one launch on NCCL: its sends cannot wait behind its recvs.
    std::stable_partition(batch.begin(), batch.end(), [](const Op& o) { return o.isSend; });
    std::vector<intrusive_ptr<HwWork>> members;
    for (auto& op : batch) {
      members.push_back(op.work);
      enqueue(std::move(op), true);
    }
    auto work = c10::make_intrusive<HwWork>(rank_, c10d::OpType::COALESCED, std::vector<at::Tensor>{});
    Op all{work, "coalesced batch", timeout_, Clock::now(), false, [members]() {
             for (auto& m : members) {
               m->wait(); // ended already: the batch ran ahead of this op
             }
           }};
    return enqueue(std::move(all), true);
  }

  void shutdown() override {
    {
      std::lock_guard<std::mutex> g(mu_);
      if (stop_) {
        return;
      }
    }
    if (!aborted_) {
      leaveTogether();
    }
    {
      std::lock_guard<std::mutex> g(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    if (worker_.joinable()) {
      worker_.join();
    }
    if (watchdog_.joinable()) {
      watchdog_.join();
    }
  }

 private:
  // The store lives in one rank's process (rank 0's TCPStore server): if it
  // exits while a peer still polls for the last collective, the peer fails
  // with "connection closed" (measured: the zoo's final barrier, 1 run in 3).
  // NCCL has no such server. Every member marks its shutdown and waits,
  // bounded, for the others' marks; a member that never shuts down costs
  // the others 10 s, not a hang.
  void leaveTogether() {
    try {
      ctlStore_->set("hw/exit/" + std::to_string(rank_), Bytes{1});
      std::vector<std::string> keys;
      for (int r = 0; r < size_; ++r) {
        keys.push_back("hw/exit/" + std::to_string(r));
      }
      const auto until = Clock::now() + std::chrono::seconds(10);
      while (!ctlStore_->check(keys) && Clock::now() < until) {
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
      }
    } catch (const std::exception& e) {
      // The store is already gone: its host left first; nothing to wait for.
    }
  }

  // --- building ops -------------------------------------------------------

  intrusive_ptr<c10d::Work> reduceAll(
      std::vector<at::Tensor>& tensors,
      const c10d::ReduceOp& red,
      std::chrono::milliseconds timeout,
      const char* name) {
    auto ts = tensors;
    const auto op = red.op_;
    checkReduceOp(op);
    return collective(
        c10d::OpType::ALLREDUCE, name, ts, timeout, pack(ts),
        [this, ts, op](std::vector<Bytes>& parts) mutable {
          std::vector<at::Tensor> acc;
          for (auto& t : ts) {
            acc.push_back(at::zeros_like(t));
          }
          for (size_t r = 0; r < parts.size(); ++r) {
            auto got = views(parts[r], ts);
            for (size_t i = 0; i < ts.size(); ++i) {
              combine(acc[i], got[i], op, r == 0);
            }
          }
          for (size_t i = 0; i < ts.size(); ++i) {
            finishReduce(acc[i], op);
            ts[i].copy_(acc[i]);
          }
        });
  }

  intrusive_ptr<c10d::Work> allgatherInto(
      std::vector<at::Tensor>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts,
      const char* name) {
    auto outs = outputs;
    auto ins = inputs;
    return collective(
        c10d::OpType::_ALLGATHER_BASE, name, outs, opts.timeout, pack(ins),
        [this, outs, ins](std::vector<Bytes>& parts) mutable {
          for (size_t i = 0; i < outs.size(); ++i) {
            auto flat = outs[i].view({-1});
            const int64_t n = ins[i].numel();
            for (size_t r = 0; r < parts.size(); ++r) {
              auto got = views(parts[r], ins);
              flat.narrow(0, static_cast<int64_t>(r) * n, n).copy_(got[i].reshape({-1}));
            }
          }
        });
  }

  intrusive_ptr<c10d::Work> reduceScatterInto(
      std::vector<at::Tensor> outputs,
      std::vector<at::Tensor> inputs,
      const c10d::ReduceScatterOptions& opts,
      const char* name) {
    const auto op = opts.reduceOp.op_;
    checkReduceOp(op);
    return collective(
        c10d::OpType::_REDUCE_SCATTER_BASE, name, outputs, opts.timeout, pack(inputs),
        [this, outputs, inputs, op](std::vector<Bytes>& parts) mutable {
          for (size_t i = 0; i < outputs.size(); ++i) {
            const int64_t n = outputs[i].numel();
            auto acc = at::zeros_like(outputs[i]).view({-1});
            for (size_t r = 0; r < parts.size(); ++r) {
              auto got = views(parts[r], inputs);
              auto mine = got[i].reshape({-1}).narrow(0, static_cast<int64_t>(rank_) * n, n);
              combine(acc, mine, op, r == 0);
            }
            finishReduce(acc, op);
            outputs[i].view({-1}).copy_(acc);
          }
        });
  }

  intrusive_ptr<c10d::Work> collective(
      c10d::OpType type,
      const char* name,
      std::vector<at::Tensor> outputs,
      std::chrono::milliseconds timeout,
      Bytes mine,
      std::function<void(std::vector<Bytes>&)> finishFn) {
    const uint64_t seq = ++seq_;
    std::string sig = signature(name, outputs);
    auto work = c10::make_intrusive<HwWork>(rank_, type, std::move(outputs));
    const std::string base = "hw/c/" + std::to_string(seq) + "/";
    Op op{work, std::string(name) + " #" + std::to_string(seq),
          timeout == c10d::kUnsetTimeout ? timeout_ : timeout, Clock::now(), false,
          [this, base, mine, finishFn, sig]() {
            Bytes framed(sig.begin(), sig.end());
            framed.push_back('\0');
            framed.insert(framed.end(), mine.begin(), mine.end());
            store_->set(base + std::to_string(rank_), framed);
            std::vector<std::string> keys;
            for (int r = 0; r < size_; ++r) {
              keys.push_back(base + std::to_string(r));
            }
            waitKeys(keys);
            auto parts = store_->multiGet(keys);
            for (auto& p : parts) {
              auto nul = std::find(p.begin(), p.end(), '\0');
              if (std::string(p.begin(), nul) != sig) {
                // Ranks called different ops, or different sizes, at the same
                // seq. NCCL hangs there (or worse); so does this backend,
                // until the watchdog's timeout.
                std::cerr << kName << ": rank " << rank_ << " " << sig << " met "
                          << std::string(p.begin(), nul) << " at the same seq: never completes"
                          << std::endl;
                blockUntilAborted();
              }
              p.erase(p.begin(), nul == p.end() ? nul : nul + 1);
            }
            finishFn(parts);
            // The last reader frees the round: the store must not grow with
            // the job's length.
            if (store_->add(base + "read", 1) == size_) {
              for (auto& k : keys) {
                store_->deleteKey(k);
              }
              store_->deleteKey(base + "read");
            }
          }};
    return enqueue(std::move(op));
  }

  // `direct`: onto the stream even inside a coalescing block (the batch's own ops).
  intrusive_ptr<c10d::Work> enqueue(Op op, bool direct = false) {
    auto work = op.work;
    {
      std::lock_guard<std::mutex> g(mu_);
      if (aborted_) {
        // NCCL after an abort: the communicator is gone, every later call fails.
        work->fail(backendError(abortMessage_));
        return work;
      }
      if (coalescing_ && !direct) {
        coalesced_.push_back(std::move(op));
        return work;
      }
      queue_.push_back(std::move(op));
    }
    cv_.notify_all();
    return work;
  }

  std::string p2pKey(int src, int dst) {
    std::lock_guard<std::mutex> g(mu_);
    const uint64_t n = ++p2pSeq_[{src, dst}];
    return "hw/p/" + std::to_string(src) + "/" + std::to_string(dst) + "/" + std::to_string(n);
  }

  // --- the stream ----------------------------------------------------------

  // Polls until every key exists. Never returns once any member of the group
  // aborted: its contribution may be there, but the communicator is gone.
  void waitKeys(const std::vector<std::string>& keys) {
    // 0.1 ms doubling to 10 ms: a healthy step waits a fraction of a ms on
    // a loaded 2-core machine; a hung peer costs ~200 store round trips a second.
    auto pause = std::chrono::microseconds(100);
    bool peerAborted = false;
    while (true) {
      if (stop_ || aborted_) {
        throw Aborted{};
      }
      if (!peerAborted && store_->check({"hw/abort"})) {
        peerAborted = true; // from now on this op never completes
      }
      if (!peerAborted && store_->check(keys)) {
        return;
      }
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, std::chrono::microseconds(10000));
    }
  }

  [[noreturn]] void blockUntilAborted() {
    while (!(stop_ || aborted_)) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    throw Aborted{};
  }

  // What every member must agree on for a collective to complete: the op and
  // the bytes each rank's outputs hold.
  static std::string signature(const char* name, const std::vector<at::Tensor>& outputs) {
    size_t bytes = 0;
    for (auto& t : outputs) {
      bytes += t.numel() * t.element_size();
    }
    return std::string(name) + "/" + std::to_string(bytes);
  }

  void workLoop() {
    while (true) {
      Op op;
      {
        std::unique_lock<std::mutex> g(mu_);
        cv_.wait(g, [this] { return stop_.load() || !queue_.empty(); });
        if (stop_) {
          break;
        }
        op = queue_.front(); // stays queued while it runs: the watchdog times it
      }
      const auto started = Clock::now();
      std::exception_ptr err;
      try {
        if (!op.work->ended()) {
          op.run();
        }
      } catch (const Aborted&) {
        err = backendError(abortMessage());
      } catch (...) {
        err = std::current_exception();
      }
      {
        std::lock_guard<std::mutex> g(mu_);
        if (!queue_.empty() && queue_.front().work == op.work) {
          queue_.pop_front();
        }
      }
      if (err) {
        op.work->fail(err);
        continue;
      }
      const float ms = std::chrono::duration<float, std::milli>(Clock::now() - started).count();
      // Ended first, hooks after: the recorder's post-hook asks the Work
      // whether it finished, so it never misses a completion in between.
      if (op.work->succeed(ms)) {
        fireCompletion(op.work->getCompletionKey(), ms);
      }
    }
    failAll("hwhooks: backend shut down");
  }

  void fireCompletion(uint64_t key, float ms) {
    c10d::CompletionHookArgs args;
    args.completionKey = key;
    args.duration_ms = ms;
    std::lock_guard<std::mutex> g(hookMu_);
    // torch's recorder hook: short, C++, takes no GIL (Hooks.hpp's contract).
    for (auto& [id, hook] : completionHooks_) {
      hook(args);
    }
  }

  // --- the watchdog ------------------------------------------------------

  void watchdogLoop() {
    while (true) {
      std::string timedOut;
      {
        std::unique_lock<std::mutex> g(mu_);
        // 50 ms: a timeout is noticed within 5% of a 1 s timeout.
        cv_.wait_for(g, std::chrono::milliseconds(50), [this] { return stop_.load(); });
        if (stop_ || aborted_) {
          if (stop_) {
            return;
          }
          continue;
        }
        const auto now = Clock::now();
        for (auto& op : queue_) {
          const auto age = std::chrono::duration_cast<std::chrono::milliseconds>(now - op.enqueued);
          if (age > op.timeout) {
            timedOut = "[Rank " + std::to_string(rank_) + "] " + kName +
                ": Watchdog caught collective operation timeout: " + op.what +
                " ran for " + std::to_string(age.count()) + " milliseconds before timing out (timeout " +
                std::to_string(op.timeout.count()) + " ms).";
            break;
          }
        }
      }
      if (!timedOut.empty()) {
        abort(timedOut);
      }
    }
  }

  void abort(const std::string& why) {
    {
      std::lock_guard<std::mutex> g(mu_);
      if (aborting_) {
        return;
      }
      abortMessage_ = why;
      aborting_ = true;
    }
    std::cerr << why << std::endl;
    // The rest of the group learns the communicator is gone (ncclCommAbort).
    try {
      ctlStore_->set("hw/abort", Bytes(why.begin(), why.end()));
    } catch (const std::exception& e) {
      std::cerr << kName << ": could not publish the abort: " << e.what() << std::endl;
    }
    // Abort hooks run before the work fails, as NCCL2's watchdog does: the
    // process may be torn down as soon as the caller sees the error.
    // Called outside hookMu_: a hook registered from Python takes the GIL,
    // and a Python thread registering a hook meanwhile holds it.
    std::map<int64_t, c10d::AbortHook> hooks;
    {
      std::lock_guard<std::mutex> g(hookMu_);
      hooks = abortHooks_;
    }
    for (auto& [id, hook] : hooks) {
      try {
        hook();
      } catch (const std::exception& e) {
        std::cerr << kName << ": abort hook " << id << " failed: " << e.what() << std::endl;
      }
    }
    // torch's hook writes its dump asynchronously and tells the backend
    // nothing when done; legacy NCCL waits TORCH_*_WAIT_TIMEOUT_DUMP_MILSEC
    // for it before tearing down. Same variables, same order.
    std::this_thread::sleep_for(std::chrono::milliseconds(dumpWaitMs()));
    // Only now does the work fail (and the caller see the error): until here
    // the stream keeps waiting, so the process is not torn down mid-dump.
    {
      std::lock_guard<std::mutex> g(mu_);
      aborted_ = true;
    }
    failAll(why);
  }

  static int64_t dumpWaitMs() {
    for (const char* var : {"TORCH_FR_WAIT_TIMEOUT_DUMP_MILSEC", "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC"}) {
      const char* v = std::getenv(var);
      if (v != nullptr && *v != '\0') {
        return std::max<int64_t>(0, std::atoll(v));
      }
    }
    return 1000; // the dump of a 2,000-entry buffer takes ~30 ms; ample
  }

  void failAll(const std::string& why) {
    std::deque<Op> pending;
    std::vector<Op> batched;
    {
      std::lock_guard<std::mutex> g(mu_);
      pending = queue_;
      batched.swap(coalesced_);
    }
    auto err = backendError(why);
    for (auto& op : pending) {
      op.work->fail(err);
    }
    for (auto& op : batched) {
      op.work->fail(err);
    }
  }

  std::string abortMessage() {
    std::lock_guard<std::mutex> g(mu_);
    return abortMessage_.empty() ? kName + ": aborted" : abortMessage_;
  }

  // --- tensors as bytes ---------------------------------------------------

  static Bytes pack(const std::vector<at::Tensor>& ts) {
    size_t total = 0;
    for (auto& t : ts) {
      TORCH_CHECK(t.device().is_cpu(), kName, ": CPU tensors only");
      total += t.numel() * t.element_size();
    }
    Bytes out(total);
    size_t off = 0;
    for (auto& t : ts) {
      auto c = t.contiguous();
      const size_t n = c.numel() * c.element_size();
      std::memcpy(out.data() + off, c.data_ptr(), n);
      off += n;
    }
    return out;
  }

  // Views into `b` shaped like `like`; valid while `b` lives.
  static std::vector<at::Tensor> views(Bytes& b, const std::vector<at::Tensor>& like) {
    std::vector<at::Tensor> out;
    size_t off = 0;
    for (auto& t : like) {
      const size_t n = t.numel() * t.element_size();
      TORCH_CHECK(off + n <= b.size(), kName, ": a peer sent ", b.size(),
                  " bytes where ", off + n, " were expected (collective mismatch?)");
      out.push_back(at::from_blob(b.data() + off, t.sizes(), t.options().device(at::kCPU)));
      off += n;
    }
    return out;
  }

  static void unpack(Bytes& b, std::vector<at::Tensor>& into) {
    auto got = views(b, into);
    for (size_t i = 0; i < into.size(); ++i) {
      into[i].copy_(got[i]);
    }
  }

  static void checkReduceOp(c10d::ReduceOp::RedOpType op) {
    using R = c10d::ReduceOp;
    TORCH_CHECK(
        op == R::SUM || op == R::AVG || op == R::PRODUCT || op == R::MIN || op == R::MAX,
        kName, ": unsupported reduce op ", static_cast<int>(op));
  }

  void combine(at::Tensor& acc, const at::Tensor& x, c10d::ReduceOp::RedOpType op, bool first) {
    using R = c10d::ReduceOp;
    if (first) {
      acc.copy_(x);
    } else if (op == R::SUM || op == R::AVG) {
      acc.add_(x);
    } else if (op == R::PRODUCT) {
      acc.mul_(x);
    } else if (op == R::MIN) {
      at::minimum_out(acc, acc, x);
    } else {
      at::maximum_out(acc, acc, x);
    }
  }

  void finishReduce(at::Tensor& acc, c10d::ReduceOp::RedOpType op) {
    if (op == c10d::ReduceOp::AVG) {
      acc.div_(size_);
    }
  }

  intrusive_ptr<c10d::Store> store_;
  intrusive_ptr<c10d::Store> ctlStore_;
  std::chrono::milliseconds timeout_;
  intrusive_ptr<Options> options_;

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Op> queue_;
  std::vector<Op> coalesced_;
  bool coalescing_ = false;
  std::atomic<bool> stop_{false};
  bool aborting_ = false; // the watchdog is running the abort (hooks first)
  std::atomic<bool> aborted_{false}; // the communicator is gone: every op fails
  std::string abortMessage_;
  uint64_t seq_ = 0;
  std::map<std::pair<int, int>, uint64_t> p2pSeq_;

  std::mutex hookMu_;
  std::map<int64_t, c10d::CompletionHook> completionHooks_;
  std::map<int64_t, c10d::AbortHook> abortHooks_;

  std::thread worker_;
  std::thread watchdog_;
};

intrusive_ptr<c10d::Backend> create(
    const intrusive_ptr<c10d::Store>& store,
    int rank,
    int size,
    std::chrono::milliseconds timeout) {
  return c10::make_intrusive<HwBackend>(store, rank, size, timeout);
}

} // namespace hwhooks

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "hwhooks: a CPU backend with NCCL2's completion and abort hooks (tests only)";
  m.def("create", &hwhooks::create, "The backend creator for dist.Backend.register_backend",
        pybind11::arg("store"), pybind11::arg("rank"), pybind11::arg("size"),
        pybind11::arg("timeout"));
}
