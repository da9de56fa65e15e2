// AES-256-GCM for the frames of a tensor-parallel link (tensor_link.h) in a cluster with a secret,
// as the pipeline's links seal theirs (node/pipeline/link_auth.py), on OpenSSL's libcrypto: the
// Python `cryptography` package keeps its OpenSSL private, and a decode step's sums run inside one
// native operation, where Python cannot be called.
//
// One `Seal` per pair of ranks, made from the key both ends derived in their handshake. Each
// direction numbers its records from 0; the nonce is (0x80000000 | the sender's rank, the record's
// number), so the two directions never share a nonce, nor do they share one with the Python side's
// frames under the same key (whose nonces start with four zero bytes). A record that was altered,
// replayed, dropped or reordered fails to open. Built without OpenSSL, `can_seal()` is false and a
// `Seal` cannot be made: a cluster with a secret then refuses tensor sharding, with the reason.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace shoal {

constexpr size_t kSealTag = 16;  // bytes a sealed record adds (GCM's tag)
constexpr size_t kSealKey = 32;  // AES-256

bool can_seal();

class Seal {
 public:
  // Throws std::invalid_argument without OpenSSL or for a key of another size.
  Seal(const std::string& key, int me, int peer);
  ~Seal();
  Seal(const Seal&) = delete;
  Seal& operator=(const Seal&) = delete;

  // out[0, bytes + kSealTag): the next record this rank sends to the peer.
  void seal(const char* in, size_t bytes, char* out);
  // out[0, bytes): the next record from the peer, in[0, bytes + kSealTag); false if it fails.
  bool open(const char* in, size_t bytes, char* out);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace shoal
