// One direction of a sealed link: AES-256-GCM records numbered by a per-direction sequence (sealing.py).
#pragma once
#include <cstddef>
#include <cstdint>

typedef struct evp_cipher_ctx_st EVP_CIPHER_CTX;

namespace zen {

constexpr size_t GCM_TAG = 16;
constexpr size_t CHUNK = 1 << 20;  // payload bytes per sealed record
constexpr size_t KEY_BYTES = 32;

// Bytes a payload of `size` takes on the wire once sealed (a GCM tag per record).
inline uint64_t sealed_size(uint64_t size) { return size + GCM_TAG * ((size + CHUNK - 1) / CHUNK); }

// The nonce is never sent: 4 zero bytes then the little-endian u64 sequence number of the record.
class Sealer {
 public:
  explicit Sealer(const uint8_t key[KEY_BYTES]);
  ~Sealer();
  Sealer(const Sealer&) = delete;
  Sealer& operator=(const Sealer&) = delete;
  // out: len ciphertext bytes then the 16-byte tag. aad may be null. Returns false on an OpenSSL failure.
  bool seal(const uint8_t* in, size_t len, const uint8_t* aad, size_t aad_len, uint8_t* out);
  // Every record of a payload into out (sealed_size(len) bytes).
  bool seal_payload(const uint8_t* in, size_t len, uint8_t* out);
  uint64_t sequence() const { return seq_; }

 private:
  EVP_CIPHER_CTX* ctx_;
  uint64_t seq_ = 0;
};

class Opener {
 public:
  explicit Opener(const uint8_t key[KEY_BYTES]);
  ~Opener();
  Opener(const Opener&) = delete;
  Opener& operator=(const Opener&) = delete;
  // in: len ciphertext bytes then the 16-byte tag; out may equal in. False if it fails authentication
  // (the sequence advances anyway: the link is dropped then).
  bool open(const uint8_t* in, size_t len, const uint8_t* aad, size_t aad_len, uint8_t* out);

 private:
  EVP_CIPHER_CTX* ctx_;
  uint64_t seq_ = 0;
};

}  // namespace zen
