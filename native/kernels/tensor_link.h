// The links of a tensor-parallel group (node/tensor): every rank holds a slice of each layer, and
// the ranks sum their partial outputs twice a layer and gather the head's vocabulary slices.
//
// Why our own sockets and not mx.distributed (MLX's "ring" backend, which works on these CPUs:
// ~65 us an all_sum of 2,048 floats between two local processes): the decode step of a whole layer
// stack is one native operation (stack.h), and a sum in the middle of it cannot be an MLX operation;
// the ring neither proves who connects (node/pipeline/link_auth does, on these same sockets, before
// they get here) nor bounds a wait on a peer that froze.
//
// A link owns one connected TCP socket per other rank. Every exchange is framed (kind, byte count)
// and checked, so ranks that ran different graphs fail instead of summing garbage. A failure
// (peer closed, timeout, a frame that does not match) breaks the link for good: later calls do
// nothing, `error()` says what happened, and the Python side checks it after each step (an
// exception cannot leave MLX's stream thread). Calls come from one thread at a time: MLX's stream
// thread inside a step, the Python thread between steps. Given a key per peer (a cluster with a
// secret), every frame travels as two AES-GCM records, its header and its payload (link_seal.h).
#pragma once

#include <mlx/mlx.h>

#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "link_seal.h"

namespace shoal {

namespace mx = mlx::core;

// Made by `std::make_shared` (the bindings' constructor does), so the copies that MLX's tasks
// hold share an ordinary C++ count: nanobind's converter hands out `shared_from_this()`. A copy
// made from a Python-owned object would take the GIL when a task drops it on MLX's stream thread,
// while the main thread may hold the GIL waiting for that very stream (mx.clear_cache): a deadlock.
class TensorLink : public std::enable_shared_from_this<TensorLink> {
 public:
  // fds[r]: a connected socket to rank r (-1 at `rank`); the link owns and closes them. keys[r]:
  // the pair's 32-byte key to seal frames with; no keys: frames in the clear.
  TensorLink(std::vector<int> fds, int rank, double timeout_s, const std::vector<std::string>& keys = {});
  ~TensorLink();
  TensorLink(const TensorLink&) = delete;
  TensorLink& operator=(const TensorLink&) = delete;

  int rank() const { return rank_; }
  int size() const { return static_cast<int>(fds_.size()); }
  bool sealed() const { return !seals_.empty(); }
  bool ok() const;
  std::string error() const;
  void close();  // breaks the link (peers see it closed); idempotent

  // data[0, n) becomes the sum over ranks, added in rank order: the same bits on every rank.
  void sum(float* data, long n);
  // The same on a thread of the link's own, so that the caller computes meanwhile (a prefill
  // chunk's 6 MB sums take ~50 ms at 1 Gbit/s). Sums queue and run in the order started (the same
  // order on every rank); `wait(ticket)` returns once the sum that start_sum numbered so is done.
  // Nothing else may use the link while any is queued.
  long start_sum(float* data, long n);
  void wait(long ticket);
  // Rank 0: out[m, :] = the ranks' parts [m, widths[r]] side by side, in rank order. Others send
  // their part [rows, widths[rank]] to rank 0 and leave out alone.
  void gather(const float* part, long rows, const std::vector<long>& widths, float* out);
  // Rank 0 sends `payload` to every other rank; the others return what rank 0 sent. A negative
  // timeout waits for as long as it takes (an idle follower), still ending at a closed link.
  void broadcast(const std::string& payload);
  std::string receive(double timeout_s);

 private:
  struct Transfer {
    int peer;
    const char* send = nullptr;
    size_t send_bytes = 0;
    char* recv = nullptr;
    size_t recv_bytes = 0;
  };
  bool run(std::vector<Transfer>& transfers, double timeout_s, const char* what);
  bool framed(uint32_t kind, const void* data, size_t bytes, const std::vector<int>& to,
              const std::vector<int>& from, std::vector<std::vector<char>>& received, double timeout_s);
  void fail(const std::string& why);
  bool opened(int peer, const char* in, size_t bytes, char* out, const char* what);

  std::vector<int> fds_;
  int rank_;
  double timeout_s_;
  mutable std::mutex error_mutex_;
  std::string error_;
  std::vector<std::vector<char>> scratch_;
  std::vector<std::unique_ptr<Seal>> seals_;  // by peer (none at this rank), or empty: open
  std::vector<std::vector<char>> raw_;        // sealed records as they arrive, by peer
  std::vector<std::vector<char>> sealed_;     // sealed records to send, by peer
  // start_sum's worker, started on first use.
  std::mutex job_mutex_;
  std::condition_variable job_cv_;
  std::deque<std::pair<float*, long>> jobs_;
  long started_ = 0, done_ = 0;  // sums queued and finished, ever: tickets count them
  bool stopping_ = false;
  std::thread worker_;
};

// x summed over the link's ranks (float32, x's shape), as one MLX operation.
mx::array link_sum(const mx::array& x, std::shared_ptr<TensorLink> link, mx::StreamOrDevice s = {});
// x [..., widths[rank]] gathered along its last axis on rank 0: [..., sum(widths)] (zeros elsewhere).
mx::array link_gather(const mx::array& x, std::shared_ptr<TensorLink> link, std::vector<long> widths,
                      mx::StreamOrDevice s = {});

}  // namespace shoal
