// AES-256-GCM records for tensor links (link_seal.h).
#include "link_seal.h"

#include <algorithm>
#include <stdexcept>

#ifdef SHOAL_HAVE_OPENSSL
#include <openssl/evp.h>
#endif

namespace shoal {

#ifdef SHOAL_HAVE_OPENSSL

bool can_seal() { return true; }

namespace {

void nonce(uint32_t sender, uint64_t number, unsigned char out[12]) {
  const uint32_t tag = 0x80000000u | sender;
  for (int i = 0; i < 4; i++) out[i] = static_cast<unsigned char>(tag >> (24 - 8 * i));
  for (int i = 0; i < 8; i++) out[4 + i] = static_cast<unsigned char>(number >> (56 - 8 * i));
}

constexpr size_t kChunk = size_t{1} << 30;  // EVP takes an int's worth of bytes a call

}  // namespace

struct Seal::Impl {
  EVP_CIPHER_CTX* enc = nullptr;
  EVP_CIPHER_CTX* dec = nullptr;
  uint32_t me = 0, peer = 0;
  uint64_t sent = 0, received = 0;
  ~Impl() {
    EVP_CIPHER_CTX_free(enc);
    EVP_CIPHER_CTX_free(dec);
  }
};

Seal::Seal(const std::string& key, int me, int peer) : impl_(std::make_unique<Impl>()) {
  if (key.size() != kSealKey) throw std::invalid_argument("[shoal Seal] a link key is 32 bytes");
  Impl& s = *impl_;
  s.me = static_cast<uint32_t>(me), s.peer = static_cast<uint32_t>(peer);
  s.enc = EVP_CIPHER_CTX_new(), s.dec = EVP_CIPHER_CTX_new();
  const auto* k = reinterpret_cast<const unsigned char*>(key.data());
  if (!s.enc || !s.dec || EVP_EncryptInit_ex(s.enc, EVP_aes_256_gcm(), nullptr, k, nullptr) != 1 ||
      EVP_DecryptInit_ex(s.dec, EVP_aes_256_gcm(), nullptr, k, nullptr) != 1)
    throw std::runtime_error("[shoal Seal] OpenSSL could not set up AES-256-GCM");
}

Seal::~Seal() = default;

void Seal::seal(const char* in, size_t bytes, char* out) {
  Impl& s = *impl_;
  unsigned char iv[12];
  nonce(s.me, s.sent++, iv);
  auto* o = reinterpret_cast<unsigned char*>(out);
  const auto* i = reinterpret_cast<const unsigned char*>(in);
  int n = 0;
  EVP_EncryptInit_ex(s.enc, nullptr, nullptr, nullptr, iv);
  for (size_t at = 0; at < bytes; at += kChunk)  // GCM is a stream: the output keeps pace with the input
    EVP_EncryptUpdate(s.enc, o + at, &n, i + at, static_cast<int>(std::min(kChunk, bytes - at)));
  EVP_EncryptFinal_ex(s.enc, o + bytes, &n);
  EVP_CIPHER_CTX_ctrl(s.enc, EVP_CTRL_GCM_GET_TAG, kSealTag, o + bytes);
}

bool Seal::open(const char* in, size_t bytes, char* out) {
  Impl& s = *impl_;
  unsigned char iv[12];
  nonce(s.peer, s.received++, iv);
  auto* o = reinterpret_cast<unsigned char*>(out);
  const auto* i = reinterpret_cast<const unsigned char*>(in);
  int n = 0;
  EVP_DecryptInit_ex(s.dec, nullptr, nullptr, nullptr, iv);
  for (size_t at = 0; at < bytes; at += kChunk)
    if (EVP_DecryptUpdate(s.dec, o + at, &n, i + at, static_cast<int>(std::min(kChunk, bytes - at))) != 1) return false;
  unsigned char tag[kSealTag];
  std::copy(i + bytes, i + bytes + kSealTag, tag);
  EVP_CIPHER_CTX_ctrl(s.dec, EVP_CTRL_GCM_SET_TAG, kSealTag, tag);
  return EVP_DecryptFinal_ex(s.dec, o + bytes, &n) == 1;
}

#else

bool can_seal() { return false; }
struct Seal::Impl {};
Seal::Seal(const std::string&, int, int) {
  throw std::invalid_argument("[shoal Seal] the kernels were built without OpenSSL: tensor links cannot seal");
}
Seal::~Seal() = default;
void Seal::seal(const char*, size_t, char*) {}
bool Seal::open(const char*, size_t, char*) { return false; }

#endif

}  // namespace shoal
