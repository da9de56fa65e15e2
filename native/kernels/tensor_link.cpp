// A tensor-parallel group's links (tensor_link.h): framed exchanges over nonblocking sockets.
#include "tensor_link.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <stdexcept>

#include "fused_util.h"

namespace shoal {

namespace {

// What a frame carries; a rank expecting one kind and reading another has run another graph.
enum Kind : uint32_t { kSum = 0x53484f01, kGather = 0x53484f02, kCommand = 0x53484f03 };

struct Header {
  uint32_t kind;
  uint32_t rank;  // the sender's
  uint64_t bytes;
};

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

std::vector<char> frame(uint32_t kind, int rank, const void* data, size_t bytes) {
  std::vector<char> out(sizeof(Header) + bytes);
  const Header h{kind, static_cast<uint32_t>(rank), bytes};
  std::memcpy(out.data(), &h, sizeof h);
  if (bytes) std::memcpy(out.data() + sizeof h, data, bytes);
  return out;
}

}  // namespace

TensorLink::TensorLink(std::vector<int> fds, int rank, double timeout_s, const std::vector<std::string>& keys)
    : fds_(std::move(fds)), rank_(rank), timeout_s_(timeout_s), scratch_(fds_.size()), raw_(fds_.size()), sealed_(fds_.size()) {
  if (rank_ < 0 || rank_ >= size()) throw std::invalid_argument("[shoal TensorLink] rank outside the group");
  if (!keys.empty()) {
    if (static_cast<int>(keys.size()) != size()) throw std::invalid_argument("[shoal TensorLink] give a key a rank");
    seals_.resize(keys.size());
    for (int r = 0; r < size(); r++)
      if (r != rank_) seals_[r] = std::make_unique<Seal>(keys[r], rank_, r);
  }
  for (int r = 0; r < size(); r++) {
    if ((r == rank_) != (fds_[r] < 0)) throw std::invalid_argument("[shoal TensorLink] give a socket for every other rank");
    if (r != rank_) fcntl(fds_[r], F_SETFL, fcntl(fds_[r], F_GETFL) | O_NONBLOCK);
  }
}

TensorLink::~TensorLink() {
  {
    std::lock_guard<std::mutex> lock(job_mutex_);
    stopping_ = true;
  }
  job_cv_.notify_all();
  if (worker_.joinable()) worker_.join();
  close();
}

long TensorLink::start_sum(float* data, long n) {
  std::lock_guard<std::mutex> lock(job_mutex_);
  if (!worker_.joinable()) {
    worker_ = std::thread([this] {
      std::unique_lock<std::mutex> hold(job_mutex_);
      for (;;) {
        job_cv_.wait(hold, [&] { return !jobs_.empty() || stopping_; });
        if (stopping_) return;
        const auto [data, n] = jobs_.front();
        jobs_.pop_front();
        hold.unlock();
        sum(data, n);
        hold.lock();
        done_++;
        job_cv_.notify_all();
      }
    });
  }
  jobs_.emplace_back(data, n);
  job_cv_.notify_all();
  return ++started_;
}

void TensorLink::wait(long ticket) {
  std::unique_lock<std::mutex> lock(job_mutex_);
  job_cv_.wait(lock, [&] { return done_ >= ticket; });
}

bool TensorLink::ok() const {
  std::lock_guard<std::mutex> lock(error_mutex_);
  return error_.empty();
}

std::string TensorLink::error() const {
  std::lock_guard<std::mutex> lock(error_mutex_);
  return error_;
}

void TensorLink::fail(const std::string& why) {
  {
    std::lock_guard<std::mutex> lock(error_mutex_);
    if (error_.empty()) error_ = why;
  }
  close();
}

void TensorLink::close() {
  for (int& fd : fds_)
    if (fd >= 0) ::close(fd), fd = -1;
  std::lock_guard<std::mutex> lock(error_mutex_);
  if (error_.empty()) error_ = "the link was closed";
}

bool TensorLink::run(std::vector<Transfer>& transfers, double timeout_s, const char* what) {
  const double deadline = timeout_s < 0 ? 0 : now_s() + timeout_s;
  for (;;) {
    std::vector<pollfd> polls;
    std::vector<Transfer*> owners;
    for (Transfer& t : transfers) {
      const short events = (t.send_bytes ? POLLOUT : 0) | (t.recv_bytes ? POLLIN : 0);
      if (events) polls.push_back({fds_[t.peer], events, 0}), owners.push_back(&t);
    }
    if (polls.empty()) return true;
    int wait_ms = -1;
    if (timeout_s >= 0) {
      const double left = deadline - now_s();
      if (left <= 0) {
        fail(std::string("timed out after ") + std::to_string(timeout_s) + " s waiting for rank " +
             std::to_string(owners[0]->peer) + " (" + what + ")");
        return false;
      }
      wait_ms = static_cast<int>(left * 1000) + 1;
    }
    const int ready = ::poll(polls.data(), polls.size(), wait_ms);
    if (ready < 0 && errno != EINTR) return fail(std::string("poll: ") + std::strerror(errno)), false;
    for (size_t i = 0; ready > 0 && i < polls.size(); i++) {
      Transfer& t = *owners[i];
      const short ev = polls[i].revents;
      if (t.send_bytes && (ev & (POLLOUT | POLLERR | POLLHUP))) {
        const ssize_t n = ::send(fds_[t.peer], t.send, t.send_bytes, MSG_NOSIGNAL);
        if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
          fail("rank " + std::to_string(t.peer) + " closed the link (" + what + ": " + std::strerror(errno) + ")");
          return false;
        }
        if (n > 0) t.send += n, t.send_bytes -= static_cast<size_t>(n);
      }
      if (t.recv_bytes && (ev & (POLLIN | POLLERR | POLLHUP))) {
        const ssize_t n = ::recv(fds_[t.peer], t.recv, t.recv_bytes, 0);
        if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
          fail("rank " + std::to_string(t.peer) + " closed the link (" + what + ")");
          return false;
        }
        if (n > 0) t.recv += n, t.recv_bytes -= static_cast<size_t>(n);
      }
    }
  }
}

bool TensorLink::framed(uint32_t kind, const void* data, size_t bytes, const std::vector<int>& to,
                        const std::vector<int>& from, std::vector<std::vector<char>>& received,
                        double timeout_s) {
  if (!ok()) return false;
  const char* what = kind == kSum ? "sum" : kind == kGather ? "gather" : "command";
  const std::vector<char> out = frame(kind, rank_, data, bytes);
  const size_t tag = sealed() ? kSealTag : 0;
  std::vector<Transfer> transfers;
  for (int peer : to) {
    const char* send = out.data();
    if (sealed()) {  // the header and the payload, each a record (a command's receiver reads them apart)
      std::vector<char>& s = sealed_[peer];
      s.resize(out.size() + 2 * tag);
      seals_[peer]->seal(out.data(), sizeof(Header), s.data());
      seals_[peer]->seal(out.data() + sizeof(Header), bytes, s.data() + sizeof(Header) + tag);
      send = s.data();
    }
    transfers.push_back({peer, send, out.size() + 2 * tag});
  }
  for (int peer : from) {
    auto it = std::find_if(transfers.begin(), transfers.end(), [&](const Transfer& t) { return t.peer == peer; });
    if (it == transfers.end()) transfers.push_back({peer}), it = transfers.end() - 1;
    std::vector<char>& into = sealed() ? raw_[peer] : received[peer];
    if (sealed()) into.resize(received[peer].size() + 2 * tag);
    it->recv = into.data(), it->recv_bytes = into.size();
  }
  if (!run(transfers, timeout_s, what)) return false;
  for (int peer : from) {
    if (sealed() && !(opened(peer, raw_[peer].data(), sizeof(Header), received[peer].data(), what) &&
                      opened(peer, raw_[peer].data() + sizeof(Header) + tag, received[peer].size() - sizeof(Header),
                             received[peer].data() + sizeof(Header), what)))
      return false;
    Header h;
    std::memcpy(&h, received[peer].data(), sizeof h);
    if (h.kind != kind || h.rank != static_cast<uint32_t>(peer) ||
        h.bytes != received[peer].size() - sizeof(Header)) {
      fail("rank " + std::to_string(peer) + " sent another exchange than this rank's (the ranks ran different steps)");
      return false;
    }
  }
  return true;
}

bool TensorLink::opened(int peer, const char* in, size_t bytes, char* out, const char* what) {
  if (!sealed()) return std::memcpy(out, in, bytes), true;
  if (seals_[peer]->open(in, bytes, out)) return true;
  fail("a frame from rank " + std::to_string(peer) + " failed authentication (" + what +
       ": altered, replayed or out of order, or sealed with another key)");
  return false;
}

void TensorLink::sum(float* data, long n) {
  const size_t bytes = static_cast<size_t>(n) * sizeof(float);
  std::vector<int> peers;
  for (int r = 0; r < size(); r++)
    if (r != rank_) peers.push_back(r), scratch_[r].resize(sizeof(Header) + bytes);
  if (!framed(kSum, data, bytes, peers, peers, scratch_, timeout_s_)) return;
  std::vector<const float*> values(size());
  for (int r = 0; r < size(); r++)
    values[r] = r == rank_ ? data : reinterpret_cast<const float*>(scratch_[r].data() + sizeof(Header));
  for (long i = 0; i < n; i++) {  // rank order on every rank: identical bits everywhere
    float s = values[0][i];
    for (int r = 1; r < size(); r++) s += values[r][i];
    data[i] = s;
  }
}

void TensorLink::gather(const float* part, long rows, const std::vector<long>& widths, float* out) {
  if (static_cast<int>(widths.size()) != size()) return fail("gather: give one width a rank");
  const size_t mine = static_cast<size_t>(rows) * widths[rank_] * sizeof(float);
  if (rank_ != 0) {
    framed(kGather, part, mine, {0}, {}, scratch_, timeout_s_);
    return;
  }
  std::vector<int> peers;
  for (int r = 1; r < size(); r++)
    peers.push_back(r), scratch_[r].resize(sizeof(Header) + static_cast<size_t>(rows) * widths[r] * sizeof(float));
  if (!framed(kGather, nullptr, 0, {}, peers, scratch_, timeout_s_)) return;
  long total = 0;
  for (long w : widths) total += w;
  long column = 0;
  for (int r = 0; r < size(); r++) {
    const float* src = r == 0 ? part : reinterpret_cast<const float*>(scratch_[r].data() + sizeof(Header));
    for (long m = 0; m < rows; m++) std::memcpy(out + m * total + column, src + m * widths[r], widths[r] * sizeof(float));
    column += widths[r];
  }
}

void TensorLink::broadcast(const std::string& payload) {
  if (rank_ != 0) return fail("only rank 0 sends commands");
  std::vector<int> peers;
  for (int r = 1; r < size(); r++) peers.push_back(r);
  framed(kCommand, payload.data(), payload.size(), peers, {}, scratch_, timeout_s_);
}

std::string TensorLink::receive(double timeout_s) {
  if (rank_ == 0) return fail("rank 0 sends commands, it receives none"), std::string();
  if (!ok()) return {};
  const size_t tag = sealed() ? kSealTag : 0;
  Header h{};
  std::vector<char>& raw = raw_[0];
  raw.resize(sizeof h + tag);
  std::vector<Transfer> head{{0, nullptr, 0, raw.data(), raw.size()}};
  if (!run(head, timeout_s, "command")) return {};
  if (!opened(0, raw.data(), sizeof h, reinterpret_cast<char*>(&h), "command")) return {};
  if (h.kind != kCommand || h.rank != 0 || h.bytes > (1ul << 30))
    return fail("rank 0 sent another exchange than a command (the ranks ran different steps)"), std::string();
  std::string payload(h.bytes, '\0');
  raw.resize(h.bytes + tag);
  std::vector<Transfer> body{{0, nullptr, 0, raw.data(), raw.size()}};
  if (!run(body, timeout_s_, "command")) return {};
  if (!opened(0, raw.data(), h.bytes, payload.data(), "command")) return {};
  return payload;
}

namespace {

using fused_detail::dispatch;

class LinkSum : public mx::Primitive {
 public:
  LinkSum(mx::Stream stream, std::shared_ptr<TensorLink> link) : mx::Primitive(stream), link_(std::move(link)) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    mx::array& out = outputs[0];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    dispatch(stream(), inputs, {out}, [x = inputs[0].data<float>(), y = out.data<float>(), n = out.size(), link = link_] {
      std::memcpy(y, x, n * sizeof(float));
      link->sum(y, static_cast<long>(n));
    });
  }
  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override { no_gpu(name()); }
  const char* name() const override { return "ShoalLinkSum"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return link_ == static_cast<const LinkSum&>(other).link_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override { return {inputs[0].shape()}; }

 private:
  std::shared_ptr<TensorLink> link_;
};

class LinkGather : public mx::Primitive {
 public:
  LinkGather(mx::Stream stream, std::shared_ptr<TensorLink> link, std::vector<long> widths)
      : mx::Primitive(stream), link_(std::move(link)), widths_(std::move(widths)) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    mx::array& out = outputs[0];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    const long rows = static_cast<long>(inputs[0].size() / widths_[link_->rank()]);
    dispatch(stream(), inputs, {out},
             [x = inputs[0].data<float>(), y = out.data<float>(), n = out.size(), rows, link = link_, w = widths_] {
               if (link->rank() != 0) std::memset(y, 0, n * sizeof(float));
               link->gather(x, rows, w, y);
             });
  }
  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override { no_gpu(name()); }
  const char* name() const override { return "ShoalLinkGather"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const LinkGather&>(other);
    return link_ == o.link_ && widths_ == o.widths_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    mx::Shape shape = inputs[0].shape();
    long total = 0;
    for (long w : widths_) total += w;
    shape.back() = static_cast<int>(total);
    return {shape};
  }

 private:
  std::shared_ptr<TensorLink> link_;
  std::vector<long> widths_;
};

}  // namespace

mx::array link_sum(const mx::array& x, std::shared_ptr<TensorLink> link, mx::StreamOrDevice s) {
  if (!link) throw std::invalid_argument("[shoal link_sum] no link");
  const mx::array in = mx::contiguous(mx::astype(x, mx::float32, s), false, s);
  return mx::array(in.shape(), mx::float32, std::make_shared<LinkSum>(mx::to_stream(s), std::move(link)), {in});
}

mx::array link_gather(const mx::array& x, std::shared_ptr<TensorLink> link, std::vector<long> widths,
                      mx::StreamOrDevice s) {
  if (!link) throw std::invalid_argument("[shoal link_gather] no link");
  if (static_cast<int>(widths.size()) != link->size()) throw std::invalid_argument("[shoal link_gather] one width a rank");
  if (x.ndim() < 1 || x.shape(-1) != widths[link->rank()])
    throw std::invalid_argument("[shoal link_gather] x's last axis must be this rank's width");
  const mx::array in = mx::contiguous(mx::astype(x, mx::float32, s), false, s);
  auto primitive = std::make_shared<LinkGather>(mx::to_stream(s), std::move(link), std::move(widths));
  mx::Shape shape = primitive->output_shapes({in})[0];
  return mx::array(std::move(shape), mx::float32, std::move(primitive), {in});
}

}  // namespace shoal
