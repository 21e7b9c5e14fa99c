// Counting what libtorch allocates on the CPU: the CPU's counterpart of
// `torch.cuda.memory_allocated` and `max_memory_allocated`, which is what
// activations and autograd's temporaries show up in (the engine's flat
// buffers are Rust's own memory and do not pass through here).
//
// The count wraps whatever CPU allocator libtorch had when it was turned on:
// each allocation takes 64 bytes more from it and writes its length there,
// so a free knows what to subtract without a table or a lock. The pointer
// handed out is the allocator's plus 64 (still 64-byte aligned) and is its
// own context, so libtorch still treats it as a plain allocation (its raw
// interface, its copy-on-write clones). Memory allocated before the count
// was turned on keeps its own deleter and is neither counted nor
// subtracted.

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <string>

namespace {

constexpr size_t kHeader = 64;

std::atomic<int64_t> now_bytes{0};
std::atomic<int64_t> peak_bytes{0};
c10::Allocator *inner = nullptr;
c10::DeleterFnPtr inner_free = nullptr;

void raise_peak(int64_t v) {
  int64_t p = peak_bytes.load(std::memory_order_relaxed);
  while (v > p && !peak_bytes.compare_exchange_weak(p, v, std::memory_order_relaxed)) {
  }
}

void counted_free(void *data) {
  // The raw interface frees what it was given, null included (oneDNN
  // hands back what a zero-byte raw allocation returned).
  if (data == nullptr) {
    return;
  }
  char *base = static_cast<char *>(data) - kHeader;
  size_t n = 0;
  std::memcpy(&n, base, sizeof n);
  now_bytes.fetch_sub(static_cast<int64_t>(n), std::memory_order_relaxed);
  inner_free(base);
}

struct Counting final : c10::Allocator {
  // Zero bytes too get a header: every pointer handed out, through
  // `allocate` or the raw interface, is then freed by `counted_free`.
  c10::DataPtr allocate(size_t n) override {
    void *base = inner->raw_allocate(n + kHeader);
    std::memcpy(base, &n, sizeof n);
    int64_t v = now_bytes.fetch_add(static_cast<int64_t>(n), std::memory_order_relaxed) + static_cast<int64_t>(n);
    raise_peak(v);
    void *data = static_cast<char *>(base) + kHeader;
    return {data, data, &counted_free, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &counted_free; }
  void copy_data(void *dest, const void *src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

Counting counting;
std::once_flag installed;
std::string install_error;

void install() {
  c10::Allocator *current = c10::GetCPUAllocator();
  if (current == nullptr || current->raw_deleter() == nullptr) {
    install_error = "libtorch's CPU allocator has no raw interface to count through";
    return;
  }
  inner = current;
  inner_free = current->raw_deleter();
  // Priority 0 is the default allocator's; a higher one (set by someone
  // else) would keep ours out, which the check below reports.
  c10::SetCPUAllocator(&counting, 0);
  if (c10::GetCPUAllocator() != &counting) {
    install_error = "another CPU allocator was installed with a higher priority";
  }
}

}  // namespace

extern "C" {

// Turns the count on (once per process; later calls do nothing). Returns
// null or an error string the caller frees with `zrt_free_error`.
char *zrt_alloc_track() {
  try {
    std::call_once(installed, install);
    if (!install_error.empty()) {
      return strdup(install_error.c_str());
    }
    return nullptr;
  } catch (const std::exception &e) {
    return strdup(e.what());
  }
}

// Bytes libtorch holds now through the count, and at most since the count
// began or the last `zrt_alloc_reset_peak`.
int64_t zrt_alloc_now() { return now_bytes.load(std::memory_order_relaxed); }
int64_t zrt_alloc_peak() { return peak_bytes.load(std::memory_order_relaxed); }

// Starts a new peak from what is held now.
void zrt_alloc_reset_peak() { peak_bytes.store(now_bytes.load(std::memory_order_relaxed), std::memory_order_relaxed); }

}  // extern "C"
