#include "seal.h"

#include <openssl/evp.h>

#include <cstring>
#include <stdexcept>

namespace zen {
namespace {

void nonce_for(uint64_t seq, uint8_t nonce[12]) {
  std::memset(nonce, 0, 4);
  for (int i = 0; i < 8; ++i) nonce[4 + i] = static_cast<uint8_t>(seq >> (8 * i));
}

EVP_CIPHER_CTX* new_ctx(const uint8_t* key, bool encrypt) {
  EVP_CIPHER_CTX* ctx = EVP_CIPHER_CTX_new();
  if (ctx == nullptr) throw std::runtime_error("EVP_CIPHER_CTX_new failed");
  int ok = encrypt ? EVP_EncryptInit_ex(ctx, EVP_aes_256_gcm(), nullptr, key, nullptr)
                   : EVP_DecryptInit_ex(ctx, EVP_aes_256_gcm(), nullptr, key, nullptr);
  if (ok != 1) {
    EVP_CIPHER_CTX_free(ctx);
    throw std::runtime_error("AES-256-GCM init failed");
  }
  return ctx;
}

}  // namespace

Sealer::Sealer(const uint8_t key[KEY_BYTES]) : ctx_(new_ctx(key, true)) {}
Sealer::~Sealer() { EVP_CIPHER_CTX_free(ctx_); }

bool Sealer::seal(const uint8_t* in, size_t len, const uint8_t* aad, size_t aad_len, uint8_t* out) {
  uint8_t nonce[12];
  nonce_for(seq_++, nonce);
  int n = 0;
  if (EVP_EncryptInit_ex(ctx_, nullptr, nullptr, nullptr, nonce) != 1) return false;
  if (aad_len && EVP_EncryptUpdate(ctx_, nullptr, &n, aad, static_cast<int>(aad_len)) != 1) return false;
  if (len && EVP_EncryptUpdate(ctx_, out, &n, in, static_cast<int>(len)) != 1) return false;
  if (EVP_EncryptFinal_ex(ctx_, out + len, &n) != 1) return false;
  return EVP_CIPHER_CTX_ctrl(ctx_, EVP_CTRL_GCM_GET_TAG, GCM_TAG, out + len) == 1;
}

bool Sealer::seal_payload(const uint8_t* in, size_t len, uint8_t* out) {
  for (size_t start = 0; start < len; start += CHUNK) {
    size_t n = len - start < CHUNK ? len - start : CHUNK;
    if (!seal(in + start, n, nullptr, 0, out)) return false;
    out += n + GCM_TAG;
  }
  return true;
}

Opener::Opener(const uint8_t key[KEY_BYTES]) : ctx_(new_ctx(key, false)) {}
Opener::~Opener() { EVP_CIPHER_CTX_free(ctx_); }

bool Opener::open(const uint8_t* in, size_t len, const uint8_t* aad, size_t aad_len, uint8_t* out) {
  uint8_t nonce[12], tag[GCM_TAG];
  nonce_for(seq_++, nonce);
  std::memcpy(tag, in + len, GCM_TAG);  // before an in-place open overwrites nothing of it, but be plain
  int n = 0;
  if (EVP_DecryptInit_ex(ctx_, nullptr, nullptr, nullptr, nonce) != 1) return false;
  if (aad_len && EVP_DecryptUpdate(ctx_, nullptr, &n, aad, static_cast<int>(aad_len)) != 1) return false;
  if (len && EVP_DecryptUpdate(ctx_, out, &n, in, static_cast<int>(len)) != 1) return false;
  if (EVP_CIPHER_CTX_ctrl(ctx_, EVP_CTRL_GCM_SET_TAG, GCM_TAG, tag) != 1) return false;
  return EVP_DecryptFinal_ex(ctx_, out + len, &n) == 1;
}

}  // namespace zen
