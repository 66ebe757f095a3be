// Float32 kernels for MindSpore's CPU backend (see cpu_kernels.py): broadcasting Add / Sub / Mul, the
// attention's head transpose, SwiGLU's products forward and backward, the softmax backward's tail, RoPE's
// rotation forward and backward, and the generation cache's column write; at the end, the fused kernels a
// recipe opts into (train.cpu_reductions).
//
// Each output element of the kernels before those comes from the same IEEE operations on the same values, in
// the same order, as the MindSpore ops they replace compute it, so the results are theirs bit for bit (built
// with -ffp-contract=off: no fused multiply-add; no reductions, no reassociation).  What they save is memory
// traffic (one pass instead of several, no tiled copy of a broadcast operand), MindSpore's per-kernel state
// (2.10's CPU arithmetic kernel keeps 16 bytes of index per output element for a broadcast operand) and its
// launch cost (tens of microseconds per kernel on the bench machines).
// They split their rows over MindSpore's own CPU thread pool, the one its kernels split theirs over (found in the
// process at the first call: ParallelRows; where it is not found, the calling thread does all the work).  Each row
// (each element, for the elementwise kernels) is computed whole by one thread, with the caller's floating-point
// control word, so the results do not depend on the split.  A second thread of naohai's own made the tiny bench
// model's step slower (0.213 against 0.201 s, a std::thread per call, 815c3da): MindSpore's idle kernel thread
// spins on the other core waiting for its next task; this hands the second half of the rows to that thread.
//
// Broadcasting: out = x OP b, b's shape right-aligned against x's, each of its axes equal to x's or 1.
// The entry points follow MindSpore's AOT custom-op interface (ops.Custom, func_type "aot"): params = the
// inputs then the outputs, shapes[i] / ndims[i] their shapes.  They return 0, or 1 for operands they do
// not take (the Python side never passes such).

#include <dirent.h>
#include <dlfcn.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdint>
#include <cstring>
#include <functional>
#include <vector>
#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#endif

namespace {

constexpr int kMaxDims = 8;

int64_t Count(int nd, const int64_t *shape) {
  int64_t n = 1;
  for (int i = 0; i < nd; ++i) n *= shape[i];
  return n;
}

// MindSpore's CPU kernel thread pool (mindspore::ThreadPool, mindrt), reached through two exported symbols of the
// libraries MindSpore has loaded: kernel::GetActorMgrInnerThreadPool() (its CPU kernels' pool) and
// ThreadPool::ParallelLaunch(func, content, task_num), which runs func(content, task_id, ...) for every task id on
// the pool's idle threads and the caller and returns when all are done.  Not found (another MindSpore, or the
// kernels called outside it, as the tests' ctypes calls are): pool is null and the caller runs every row.
using PoolTask = std::function<int(void *, int, float, float)>;
struct ThreadPoolRef {
  void *pool = nullptr;
  int (*launch)(void *, const PoolTask &, void *, int) = nullptr;
  int64_t cores = 1;
  std::atomic<int64_t> threads{1};
  std::atomic<int> counts{0};
};

// A task finds the pool's idle kernel threads and the caller; more parts than those would run one after another on
// the caller.  The kernel threads are the process's threads MindSpore named KernelThread_<i> (0 while a pool just
// created has not started them).
int64_t KernelThreads() {
  int64_t n = 0;
  if (DIR *tasks = opendir("/proc/self/task")) {
    while (const dirent *t = readdir(tasks)) {
      char path[300], name[32] = {0};
      std::snprintf(path, sizeof path, "/proc/self/task/%s/comm", t->d_name);
      if (FILE *f = std::fopen(path, "r")) {
        if (std::fgets(name, sizeof name, f) != nullptr && std::strncmp(name, "KernelThread_", 13) == 0) ++n;
        std::fclose(f);
      }
    }
    closedir(tasks);
  }
  return n;
}

void FindThreadPool(ThreadPoolRef *ref) {
  void *ops = dlopen("libmindspore_ops_cpu.so", RTLD_LAZY | RTLD_NOLOAD);
  void *core = dlopen("libmindspore_core.so", RTLD_LAZY | RTLD_NOLOAD);
  if (ops == nullptr || core == nullptr) return;
  auto get = reinterpret_cast<void *(*)()>(dlsym(ops, "_ZN9mindspore6kernel26GetActorMgrInnerThreadPoolEv"));
  auto launch = reinterpret_cast<int (*)(void *, const PoolTask &, void *, int)>(
      dlsym(core, "_ZN9mindspore10ThreadPool14ParallelLaunchERKSt8functionIFiPviffEES2_i"));
  cpu_set_t cores;
  if (get == nullptr || launch == nullptr || sched_getaffinity(0, sizeof cores, &cores) != 0) return;
  ref->pool = get();
  ref->launch = launch;
  ref->cores = std::max(1, CPU_COUNT(&cores));
}

// The pool, and the parts a call may split into: min(cores, kernel threads + 1), counted again (up to 64 calls)
// while no kernel thread has started.
ThreadPoolRef &ThreadPool() {
  static ThreadPoolRef ref;
  static const bool found = (FindThreadPool(&ref), true);
  (void)found;
  if (ref.pool != nullptr && ref.cores > 1 && ref.threads.load() == 1 && ref.counts.fetch_add(1) < 64)
    ref.threads.store(std::max<int64_t>(1, std::min(ref.cores, KernelThreads() + 1)));
  return ref;
}

// A part's minimum work (elements touched): below it a hand-off costs more than it saves.
constexpr int64_t kGrain = 32768;

// Calls of ParallelRows that were split (what the tests read through NaohaiKernelSplits).
std::atomic<int64_t> g_splits{0};

// fn(begin, end) over [0, rows) in contiguous parts, one per thread of the pool (at most; each part at least kGrain
// elements of work, a row being row_work), with the caller's floating-point control word (MindSpore's kernel
// threads flush denormals to zero; the caller's setting is the one a single-thread call would use).
template <typename F>
void ParallelRows(int64_t rows, int64_t row_work, F fn) {
  ThreadPoolRef &ref = ThreadPool();
  const int64_t parts = std::min({ref.threads.load(), rows, rows * std::max<int64_t>(row_work, 1) / kGrain});
  if (parts <= 1 || ref.pool == nullptr) {
    fn(int64_t{0}, rows);
    return;
  }
#if defined(__x86_64__) || defined(__i386__)
  const unsigned csr = _mm_getcsr();
#endif
  PoolTask task = [&](void *, int id, float, float) {
#if defined(__x86_64__) || defined(__i386__)
    const unsigned own = _mm_getcsr();
    _mm_setcsr(csr);
#endif
    fn(rows * id / parts, rows * (id + 1) / parts);
#if defined(__x86_64__) || defined(__i386__)
    _mm_setcsr(own);
#endif
    return 0;
  };
  ref.launch(ref.pool, task, nullptr, static_cast<int>(parts));
  g_splits.fetch_add(1, std::memory_order_relaxed);
}

// ParallelRows over n elements in blocks of 1024 (an elementwise kernel's work).
template <typename F>
void ParallelElements(int64_t n, F fn) {
  constexpr int64_t kBlock = 1024;
  ParallelRows((n + kBlock - 1) / kBlock, kBlock, [&](int64_t b0, int64_t b1) {
    fn(b0 * kBlock, std::min(n, b1 * kBlock));
  });
}

// x's shape collapsed to groups of adjacent axes along which b either varies (stride > 0) or repeats
// (stride 0); axes of size 1 dropped.
struct Layout {
  int n = 0;
  int64_t size[kMaxDims];
  int64_t bstride[kMaxDims];
};

bool MakeLayout(int xd, const int64_t *xs, int bd, const int64_t *bs, Layout *out) {
  if (xd > kMaxDims || bd > xd) return false;
  int64_t sizes[kMaxDims];
  bool varies[kMaxDims];
  int n = 0;
  for (int i = 0; i < xd; ++i) {
    int j = i - (xd - bd);
    int64_t bsize = j >= 0 ? bs[j] : 1;
    if (bsize != xs[i] && bsize != 1) return false;
    if (xs[i] == 1) continue;
    bool v = bsize == xs[i];
    if (n > 0 && varies[n - 1] == v) {
      sizes[n - 1] *= xs[i];
    } else {
      sizes[n] = xs[i];
      varies[n] = v;
      ++n;
    }
  }
  int64_t stride = 1;
  for (int g = n - 1; g >= 0; --g) {
    out->size[g] = sizes[g];
    out->bstride[g] = varies[g] ? stride : 0;
    if (varies[g]) stride *= sizes[g];
  }
  out->n = n;
  return true;
}

struct Add { static float Apply(float a, float b) { return a + b; } };
struct Sub { static float Apply(float a, float b) { return a - b; } };
struct Mul { static float Apply(float a, float b) { return a * b; } };

// The layout seen as [rows, inner], inner being its last group.
template <typename Op>
void Rows(const Layout &l, const float *x, const float *b, float *out, int64_t r0, int64_t r1) {
  const int last = l.n - 1;
  const int64_t inner = l.size[last];
  const bool scalar = l.bstride[last] == 0;
  for (int64_t r = r0; r < r1; ++r) {
    int64_t rest = r, boff = 0;
    for (int g = last - 1; g >= 0; --g) {
      boff += (rest % l.size[g]) * l.bstride[g];
      rest /= l.size[g];
    }
    const float *xr = x + r * inner;
    float *o = out + r * inner;
    if (scalar) {
      const float v = b[boff];
      for (int64_t k = 0; k < inner; ++k) o[k] = Op::Apply(xr[k], v);
    } else {
      const float *br = b + boff;
      for (int64_t k = 0; k < inner; ++k) o[k] = Op::Apply(xr[k], br[k]);
    }
  }
}

template <typename Op>
int Broadcast(int nparam, void **params, int *ndims, int64_t **shapes) {
  if (nparam != 3) return 1;
  const float *x = static_cast<const float *>(params[0]);
  const float *b = static_cast<const float *>(params[1]);
  float *out = static_cast<float *>(params[2]);
  Layout l;
  if (!MakeLayout(ndims[0], shapes[0], ndims[1], shapes[1], &l)) return 1;
  if (l.n == 0) {  // every axis of size 1
    out[0] = Op::Apply(x[0], b[0]);
    return 0;
  }
  int64_t rows = 1;
  for (int g = 0; g < l.n - 1; ++g) rows *= l.size[g];
  ParallelRows(rows, l.size[l.n - 1], [&](int64_t r0, int64_t r1) { Rows<Op>(l, x, b, out, r0, r1); });
  return 0;
}

// RoPE's rotation: out = x * cos + rot(x) * sin, rot(x)[j] = x[src_j] * sign_j (x @ R for R a signed permutation
// matrix, as MatMul computes it: one nonzero term per column; 0 where the column of R is 0, the dimensions
// past rotary_dim).  x [b, n, s, d]; cos, sin [1 or b, 1, s, d]; code int32 [d]: sign_j * (src_j + 1), or 0.
bool RopeShapes(int nparam, int *ndims, int64_t **shapes) {
  if (nparam != 5 || ndims[0] != 4 || ndims[1] != 4 || ndims[2] != 4 || ndims[3] != 1) return false;
  const int64_t *xs = shapes[0], *cs = shapes[1];
  for (int i = 0; i < 4; ++i)
    if (shapes[2][i] != cs[i]) return false;
  return (cs[0] == 1 || cs[0] == xs[0]) && cs[1] == 1 && cs[2] == xs[2] && cs[3] == xs[3] && shapes[3][0] == xs[3];
}

// f(x's row, out's row, cos's row, sin's row) for every row [d] of params[0] [b, n, s, d] (out: params[4]).
template <typename F>
void RopeRows(void **params, int64_t **shapes, F f) {
  const float *x = static_cast<const float *>(params[0]), *cos = static_cast<const float *>(params[1]),
              *sin = static_cast<const float *>(params[2]);
  float *out = static_cast<float *>(params[4]);
  const int64_t *xs = shapes[0];
  const int64_t n = xs[1], s = xs[2], d = xs[3], cb = shapes[1][0];
  ParallelRows(xs[0] * n * s, d, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {                  // r = (i, h, q)
      const int64_t i = r / (n * s), q = r % s;
      const int64_t row = r * d, crow = ((cb == 1 ? 0 : i) * s + q) * d;
      f(x + row, out + row, cos + crow, sin + crow);
    }
  });
}

}  // namespace

extern "C" {
// The threads ParallelRows splits over (0: MindSpore's pool was not found, every call runs on its caller), and how
// many calls it has split so far.
int64_t NaohaiKernelThreads() { return ThreadPool().pool == nullptr ? 0 : ThreadPool().threads.load(); }
int64_t NaohaiKernelSplits() { return g_splits.load(); }

// x [a, b, c, d] -> out [a, c, b, d]: a copy.
int NaohaiSwapAxes12(int nparam, void **params, int *ndims, int64_t **shapes, const char **, void *, void *) {
  if (nparam != 2 || ndims[0] != 4) return 1;
  const float *x = static_cast<const float *>(params[0]);
  float *out = static_cast<float *>(params[1]);
  const int64_t a = shapes[0][0], b = shapes[0][1], c = shapes[0][2], d = shapes[0][3];
  ParallelRows(a * c, b * d, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {          // r = (i, k): out[i, k, :, :] gathers x[i, :, k, :]
      const int64_t i = r / c, k = r % c;
      float *o = out + r * b * d;
      for (int64_t j = 0; j < b; ++j) std::copy_n(x + ((i * b + j) * c + k) * d, d, o + j * d);
    }
  });
  return 0;
}

// SwiGLU's products: out = (g * s) * u, s = sigmoid(g) given (MindSpore's Sigmoid).
int NaohaiSwiGLU(int nparam, void **params, int *ndims, int64_t **shapes, const char **, void *, void *) {
  if (nparam != 4) return 1;
  const float *g = static_cast<const float *>(params[0]);
  const float *s = static_cast<const float *>(params[1]);
  const float *u = static_cast<const float *>(params[2]);
  float *out = static_cast<float *>(params[3]);
  const int64_t n = Count(ndims[0], shapes[0]);
  ParallelElements(n, [&](int64_t k0, int64_t k1) {
    for (int64_t k = k0; k < k1; ++k) out[k] = (g[k] * s[k]) * u[k];
  });
  return 0;
}

// Its backward, as MindSpore derives it for the two Muls: du = dy * (g * s), dg = (dy * u) * s (the product's
// own term), ds = (dy * u) * g (to Sigmoid's backward).
int NaohaiSwiGLUGrad(int nparam, void **params, int *ndims, int64_t **shapes, const char **, void *, void *) {
  if (nparam != 7) return 1;
  const float *dy = static_cast<const float *>(params[0]);
  const float *g = static_cast<const float *>(params[1]);
  const float *s = static_cast<const float *>(params[2]);
  const float *u = static_cast<const float *>(params[3]);
  float *dg = static_cast<float *>(params[4]);
  float *ds = static_cast<float *>(params[5]);
  float *du = static_cast<float *>(params[6]);
  const int64_t n = Count(ndims[0], shapes[0]);
  ParallelElements(n, [&](int64_t k0, int64_t k1) {
    for (int64_t k = k0; k < k1; ++k) {
      const float dyu = dy[k] * u[k];
      du[k] = dy[k] * (g[k] * s[k]);
      dg[k] = dyu * s[k];
      ds[k] = dyu * g[k];
    }
  });
  return 0;
}

// Softmax's backward tail: out = yd - y * m, m [..., 1] one value per row (the row sums).
int NaohaiSubMulRows(int nparam, void **params, int *ndims, int64_t **shapes, const char **, void *, void *) {
  if (nparam != 4) return 1;
  const float *yd = static_cast<const float *>(params[0]);
  const float *y = static_cast<const float *>(params[1]);
  const float *m = static_cast<const float *>(params[2]);
  float *out = static_cast<float *>(params[3]);
  const int64_t n = Count(ndims[0], shapes[0]);
  const int64_t width = shapes[0][ndims[0] - 1];
  if (Count(ndims[2], shapes[2]) * width != n) return 1;
  ParallelRows(n / width, width, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float v = m[r];
      for (int64_t k = r * width; k < (r + 1) * width; ++k) out[k] = yd[k] - y[k] * v;
    }
  });
  return 0;
}

// The generation cache's write: out = past with column s replaced by new's one column wherever slot[s] is true
// (ops.select over broadcast operands, as a copy).  past [b, n, S, d], new [b, n, 1, d], slot [1, 1, S, 1] bool.
int NaohaiWriteColumn(int nparam, void **params, int *ndims, int64_t **shapes, const char **, void *, void *) {
  if (nparam != 4 || ndims[0] != 4 || ndims[1] != 4 || ndims[2] != 4) return 1;
  const int64_t *ps = shapes[0], *ns = shapes[1], *ss = shapes[2];
  if (ns[0] != ps[0] || ns[1] != ps[1] || ns[2] != 1 || ns[3] != ps[3] || ss[0] != 1 || ss[1] != 1 ||
      ss[2] != ps[2] || ss[3] != 1)
    return 1;
  const float *past = static_cast<const float *>(params[0]);
  const float *col = static_cast<const float *>(params[1]);
  const bool *slot = static_cast<const bool *>(params[2]);
  float *out = static_cast<float *>(params[3]);
  const int64_t rows = ps[0] * ps[1], width = ps[2], d = ps[3];
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < width; ++c) {
      const float *src = slot[c] ? col + r * d : past + (r * width + c) * d;
      std::copy_n(src, d, out + (r * width + c) * d);
    }
  }
  return 0;
}

// RoPE's rotation (RopeShapes): inputs x, cos, sin, code; output out.
int NaohaiRope(int nparam, void **params, int *ndims, int64_t **shapes, const char **, void *, void *) {
  if (!RopeShapes(nparam, ndims, shapes)) return 1;
  const int32_t *code = static_cast<const int32_t *>(params[3]);
  const int64_t d = shapes[0][3];
  for (int64_t j = 0; j < d; ++j)
    if (code[j] > d || code[j] < -d) return 1;
  RopeRows(params, shapes, [&](const float *xr, float *o, const float *cr, const float *sr) {
    for (int64_t j = 0; j < d; ++j) {
      const int32_t c = code[j];
      const float rot = c > 0 ? xr[c - 1] : (c < 0 ? xr[-c - 1] * -1.0f : 0.0f);
      o[j] = xr[j] * cr[j] + rot * sr[j];
    }
  });
  return 0;
}

// Its backward, as MindSpore derives it for the ops above: dx = dout * cos + (dout * sin) @ R^T, the second term
// at x's dimension src_j being (dout[j] * sin[j]) * sign_j (0 for a dimension no column takes).  Inputs dout,
// cos, sin, code; output dx.
int NaohaiRopeGrad(int nparam, void **params, int *ndims, int64_t **shapes, const char **, void *, void *) {
  if (!RopeShapes(nparam, ndims, shapes)) return 1;
  const int32_t *code = static_cast<const int32_t *>(params[3]);
  const int64_t d = shapes[0][3];
  std::vector<int32_t> from(d, 0);          // from[src] = the code of the column that takes x[src], signed j + 1
  for (int64_t j = 0; j < d; ++j) {
    const int32_t c = code[j];
    if (c > d || c < -d) return 1;
    if (c == 0) continue;
    const int64_t src = (c > 0 ? c : -c) - 1;
    if (from[src] != 0) return 1;           // two columns from one dimension: not a signed permutation
    from[src] = c > 0 ? static_cast<int32_t>(j + 1) : -static_cast<int32_t>(j + 1);
  }
  RopeRows(params, shapes, [&](const float *dr, float *o, const float *cr, const float *sr) {
    for (int64_t k = 0; k < d; ++k) {
      const int32_t f = from[k];
      const float back = f > 0 ? dr[f - 1] * sr[f - 1] : (f < 0 ? (dr[-f - 1] * sr[-f - 1]) * -1.0f : 0.0f);
      o[k] = dr[k] * cr[k] + back;
    }
  });
  return 0;
}

int NaohaiBroadcastAdd(int nparam, void **params, int *ndims, int64_t **shapes, const char **, void *, void *) {
  return Broadcast<Add>(nparam, params, ndims, shapes);
}
int NaohaiBroadcastSub(int nparam, void **params, int *ndims, int64_t **shapes, const char **, void *, void *) {
  return Broadcast<Sub>(nparam, params, ndims, shapes);
}
int NaohaiBroadcastMul(int nparam, void **params, int *ndims, int64_t **shapes, const char **, void *, void *) {
  return Broadcast<Mul>(nparam, params, ndims, shapes);
}
}

// ---------------------------------------------------------------------------------------------------------
// Fused reductions (the recipe's train.cpu_reductions: fused).  Unlike the kernels above these sum in their
// own order (sixteen float32 lanes along a row, combined pairwise; float64 lanes for a gradient's sum of
// squares; the rows in order for a norm's gain and shift gradients), so their results differ from the
// composed MindSpore graph's in the last bits.  The order is fixed: a run repeats itself bit for bit.

namespace {
constexpr int kLanes = 16;

template <typename T>
T Fold(T *lanes) {
  for (int w = kLanes / 2; w > 0; w /= 2)
    for (int l = 0; l < w; ++l) lanes[l] += lanes[l + w];
  return lanes[0];
}

// sum of f(k) for k < n: kLanes lanes of T, then folded pairwise.
template <typename T, typename F>
T LaneSum(int64_t n, F f) {
  T lanes[kLanes] = {0};
  int64_t k = 0;
  for (; k + kLanes <= n; k += kLanes)
    for (int l = 0; l < kLanes; ++l) lanes[l] += f(k + l);
  for (int l = 0; k < n; ++k, ++l) lanes[l] += f(k);
  return Fold(lanes);
}

// A row's sum in float32 lanes.
template <typename F>
float RowSum(int64_t n, F f) {
  return LaneSum<float>(n, f);
}

// The row statistics of LayerNorm (kCentered) or RMSNorm: m = the mean of the row (0 for RMSNorm),
// rstd = 1 / sqrt(mean((x - m)^2) + eps).  The backward recomputes them from x, the same way.
template <bool kCentered>
void RowStats(const float *xr, int64_t h, float eps, float *m, float *rstd) {
  const float inv_h = 1.0f / static_cast<float>(h);
  const float mean = kCentered ? RowSum(h, [&](int64_t k) { return xr[k]; }) * inv_h : 0.0f;
  const float v = RowSum(h, [&](int64_t k) { const float c = xr[k] - mean; return c * c; }) * inv_h;
  *m = mean;
  *rstd = 1.0f / std::sqrt(v + eps);
}

// x [rows, h] -> y = (x - m) * rstd * gamma (+ beta), over the last axis.
template <bool kCentered>
void NormForward(const float *x, const float *gamma, const float *beta, float eps, int64_t r0, int64_t r1,
                 int64_t h, float *y) {
  for (int64_t r = r0; r < r1; ++r) {
    const float *xr = x + r * h;
    float m, s;
    RowStats<kCentered>(xr, h, eps, &m, &s);
    float *yr = y + r * h;
    if (kCentered) {
      for (int64_t k = 0; k < h; ++k) yr[k] = (xr[k] - m) * s * gamma[k] + beta[k];
    } else {
      for (int64_t k = 0; k < h; ++k) yr[k] = xr[k] * s * gamma[k];
    }
  }
}

// The backward: with n = (x - m) * rstd and g = dy * gamma, dx = rstd * (g - mean_k(g) - n * mean_k(g * n))
// (RMSNorm: without the mean_k(g) term), dgamma = sum over rows of dy * n, dbeta = sum over rows of dy.  dx row by
// row (its statistics kept in stats), then the column sums, each column's rows added in order (the columns split
// between threads: each sum's order is the same however they are split).
template <bool kCentered>
void NormBackward(const float *dy, const float *x, const float *gamma, float eps, int64_t rows, int64_t h,
                  float *dx, float *dgamma, float *dbeta) {
  const float inv_h = 1.0f / static_cast<float>(h);
  std::vector<float> stats(2 * rows);
  ParallelRows(rows, h, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float *dyr = dy + r * h, *xr = x + r * h;
      float m, s;
      RowStats<kCentered>(xr, h, eps, &m, &s);
      stats[2 * r] = m;
      stats[2 * r + 1] = s;
      const float a = kCentered ? RowSum(h, [&](int64_t k) { return dyr[k] * gamma[k]; }) * inv_h : 0.0f;
      const float b = RowSum(h, [&](int64_t k) { return dyr[k] * gamma[k] * ((xr[k] - m) * s); }) * inv_h;
      float *dxr = dx + r * h;
      for (int64_t k = 0; k < h; ++k) {
        const float n = (xr[k] - m) * s;
        dxr[k] = s * (dyr[k] * gamma[k] - a - n * b);
      }
    }
  });
  constexpr int64_t kColumns = 16;           // columns per block: whole vectors
  ParallelRows((h + kColumns - 1) / kColumns, kColumns * rows, [&](int64_t c0, int64_t c1) {
    const int64_t k0 = c0 * kColumns, k1 = std::min(h, c1 * kColumns);
    std::fill(dgamma + k0, dgamma + k1, 0.0f);
    if (kCentered) std::fill(dbeta + k0, dbeta + k1, 0.0f);
    for (int64_t r = 0; r < rows; ++r) {
      const float *dyr = dy + r * h, *xr = x + r * h;
      const float m = stats[2 * r], s = stats[2 * r + 1];
      for (int64_t k = k0; k < k1; ++k) dgamma[k] += dyr[k] * ((xr[k] - m) * s);
      if (kCentered)
        for (int64_t k = k0; k < k1; ++k) dbeta[k] += dyr[k];
    }
  });
}

// exp(x) in float32, vectorizable (the compiler turns a loop of it into SIMD code): x = n ln 2 + r with n
// rounded to nearest, exp(r) by Cephes' degree-7 polynomial for expf (S. L. Moshier's Cephes library), times
// 2^n built in the exponent bits.  Within 2 ulp of exp on [-87.3, 88] (measured against double); 0 below that
// range (as exp underflows: a blocked attention score), exp(88) above.
inline float ExpF(float x) {
  constexpr float kLo = -87.3365447504f, kHi = 88.0f;
  const float c = x < kLo ? kLo : (x > kHi ? kHi : x);
  const float n = (c * 1.44269504088896341f + 12582912.0f) - 12582912.0f;     // round to nearest (1.5 * 2^23)
  const float r = (c - n * 0.693359375f) - n * -2.12194440e-4f;              // ln 2 in two parts
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = (p * (r * r) + r) + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
  return x < kLo ? 0.0f : y * two_n;
}

// sigmoid(g) = 1 / (1 + exp(-g)), with ExpF.
inline float Sigmoid(float g) { return 1.0f / (1.0f + ExpF(-g)); }

// dst[k] = exp(src[k] - m) (ExpF) for k < n, and their sum in lanes (RowSum): a softmax row's exps before the
// division (dst may be src).
float ExpSum(const float *src, float m, int64_t n, float *dst) {
  for (int64_t k = 0; k < n; ++k) dst[k] = ExpF(src[k] - m);
  return RowSum(n, [&](int64_t k) { return dst[k]; });
}

// The attention's probabilities: y = softmax(x * scale + bias) over the last axis.  x [b, n, s, t]; bias
// right-aligned against it, [t] last and each other axis equal to x's or 1; scale [1].
void ScaledSoftmax(const float *x, const float *bias, const int64_t *bs, float scale, const int64_t *xs,
                   float *y) {
  const int64_t t = xs[3];
  ParallelRows(xs[0] * xs[1] * xs[2], t, [&](int64_t r0, int64_t r1) {
    for (int64_t row = r0; row < r1; ++row) {        // row = (i, j, q)
      const int64_t i = row / (xs[1] * xs[2]), j = row / xs[2] % xs[1], q = row % xs[2];
      const int64_t brow = ((bs[0] == 1 ? 0 : i) * bs[1] + (bs[1] == 1 ? 0 : j)) * bs[2] + (bs[2] == 1 ? 0 : q);
      const float *xr = x + row * t, *br = bias + brow * t;
      float *yr = y + row * t;
      float m = -INFINITY;                 // the row's maximum (exact in any order: SIMD lanes, -fopenmp-simd)
#pragma omp simd reduction(max : m)
      for (int64_t k = 0; k < t; ++k) {
        const float z = xr[k] * scale + br[k];
        yr[k] = z;
        m = z > m ? z : m;
      }
      const float inv = 1.0f / ExpSum(yr, m, t, yr);
      for (int64_t k = 0; k < t; ++k) yr[k] = yr[k] * inv;
    }
  });
}

bool IsRows(int nd, const int64_t *shape, int64_t rows, int64_t width) {
  return nd == 2 && shape[0] == rows && shape[1] == width;
}

const float *In(void **params, int i) { return static_cast<const float *>(params[i]); }
float *Out(void **params, int i) { return static_cast<float *>(params[i]); }

// The entry points' checks.  Forward: x [rows, h], gamma [h], (beta [h],) eps [1] -> y [rows, h].
template <bool kCentered>
int NormForwardEntry(int nparam, void **params, int *ndims, int64_t **shapes) {
  const int eps = kCentered ? 3 : 2;
  if (nparam != eps + 2 || ndims[0] != 2) return 1;
  const int64_t rows = shapes[0][0], h = shapes[0][1];
  if (Count(ndims[1], shapes[1]) != h || (kCentered && Count(ndims[2], shapes[2]) != h) ||
      Count(ndims[eps], shapes[eps]) != 1)
    return 1;
  ParallelRows(rows, h, [&](int64_t r0, int64_t r1) {
    NormForward<kCentered>(In(params, 0), In(params, 1), kCentered ? In(params, 2) : nullptr, *In(params, eps), r0,
                           r1, h, Out(params, eps + 1));
  });
  return 0;
}

// Backward: dy [rows, h], x [rows, h], gamma [h], eps [1] -> dx [rows, h], dgamma [h] (, dbeta [h]).
template <bool kCentered>
int NormBackwardEntry(int nparam, void **params, int *ndims, int64_t **shapes) {
  if (nparam != (kCentered ? 7 : 6) || ndims[0] != 2) return 1;
  const int64_t rows = shapes[0][0], h = shapes[0][1];
  if (!IsRows(ndims[1], shapes[1], rows, h) || Count(ndims[2], shapes[2]) != h || Count(ndims[3], shapes[3]) != 1)
    return 1;
  NormBackward<kCentered>(In(params, 0), In(params, 1), In(params, 2), *In(params, 3), rows, h, Out(params, 4),
                          Out(params, 5), kCentered ? Out(params, 6) : nullptr);
  return 0;
}
}  // namespace

extern "C" {
int NaohaiLayerNorm(int nparam, void **params, int *ndims, int64_t **shapes, const char **, void *, void *) {
  return NormForwardEntry<true>(nparam, params, ndims, shapes);
}
int NaohaiLayerNormGrad(int nparam, void **params, int *ndims, int64_t **shapes, const char **, void *, void *) {
  return NormBackwardEntry<true>(nparam, params, ndims, shapes);
}
int NaohaiRMSNorm(int nparam, void **params, int *ndims, int64_t **shapes, const char **, void *, void *) {
  return NormForwardEntry<false>(nparam, params, ndims, shapes);
}
int NaohaiRMSNormGrad(int nparam, void **params, int *ndims, int64_t **shapes, const char **, void *, void *) {
  return NormBackwardEntry<false>(nparam, params, ndims, shapes);
}

// The global gradient norm's sum of squares: inputs g_0 .. g_{n-1} (every gradient), output float32 [1].  Each
// gradient's sum of squares in kLanes float64 lanes, folded pairwise and rounded to float32; those added in input
// order from the first (as AddN adds its inputs).  One kernel for all the gradients: MindSpore spends tens of
// microseconds launching each kernel, which for a model's hundreds of small gradients cost more than the sums.
int NaohaiSquareSums(int nparam, void **params, int *ndims, int64_t **shapes, const char **, void *, void *) {
  if (nparam < 2) return 1;
  const int n = nparam - 1;
  float total = 0.0f;
  for (int i = 0; i < n; ++i) {
    const float *g = In(params, i);
    const float sum = static_cast<float>(LaneSum<double>(Count(ndims[i], shapes[i]), [&](int64_t k) {
      return static_cast<double>(g[k]) * g[k];
    }));
    total = i == 0 ? sum : total + sum;
  }
  *Out(params, n) = total;
  return 0;
}

// The attention's probabilities y = softmax(x * scale + bias) (ScaledSoftmax): x [b, n, s, t], bias [.., t]
// broadcast (at most 4 axes), scale [1] -> y [b, n, s, t].
int NaohaiScaledSoftmax(int nparam, void **params, int *ndims, int64_t **shapes, const char **, void *, void *) {
  if (nparam != 4 || ndims[0] != 4 || ndims[1] < 1 || ndims[1] > 4 || Count(ndims[2], shapes[2]) != 1) return 1;
  int64_t bs[4] = {1, 1, 1, 1};
  for (int i = 0; i < ndims[1]; ++i) bs[4 - ndims[1] + i] = shapes[1][i];
  for (int i = 0; i < 4; ++i)
    if (bs[i] != shapes[0][i] && (bs[i] != 1 || i == 3)) return 1;
  ScaledSoftmax(In(params, 0), In(params, 1), bs, *In(params, 2), shapes[0], Out(params, 3));
  return 0;
}

// Its backward: dx = (y * dy - y * sum(y * dy)) * scale, the sum over the row.  dy, y [.., t], scale [1].
int NaohaiScaledSoftmaxGrad(int nparam, void **params, int *ndims, int64_t **shapes, const char **, void *,
                            void *) {
  if (nparam != 4 || ndims[0] < 1 || Count(ndims[1], shapes[1]) != Count(ndims[0], shapes[0]) ||
      Count(ndims[2], shapes[2]) != 1)
    return 1;
  const float *dy = In(params, 0), *y = In(params, 1);
  const float scale = *In(params, 2);
  float *dx = Out(params, 3);
  const int64_t t = shapes[0][ndims[0] - 1], rows = Count(ndims[0], shapes[0]) / t;
  ParallelRows(rows, t, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float *dyr = dy + r * t, *yr = y + r * t;
      float *dxr = dx + r * t;
      const float sum = RowSum(t, [&](int64_t k) { return yr[k] * dyr[k]; });
      for (int64_t k = 0; k < t; ++k) dxr[k] = (yr[k] * dyr[k] - yr[k] * sum) * scale;
    }
  });
  return 0;
}

// SwiGLU's activation and product in one pass: out = (g * sigmoid(g)) * u.
int NaohaiSiluProduct(int nparam, void **params, int *ndims, int64_t **shapes, const char **, void *, void *) {
  if (nparam != 3 || Count(ndims[1], shapes[1]) != Count(ndims[0], shapes[0])) return 1;
  const float *g = In(params, 0), *u = In(params, 1);
  float *out = Out(params, 2);
  const int64_t n = Count(ndims[0], shapes[0]);
  ParallelElements(n, [&](int64_t k0, int64_t k1) {
    for (int64_t k = k0; k < k1; ++k) {
      const float s = Sigmoid(g[k]);
      out[k] = (g[k] * s) * u[k];
    }
  });
  return 0;
}

// Its backward: with s = sigmoid(g), du = dy * (g * s), dg = (dy * u) * (s * (1 + g * (1 - s))).
int NaohaiSiluProductGrad(int nparam, void **params, int *ndims, int64_t **shapes, const char **, void *,
                          void *) {
  if (nparam != 5) return 1;
  const int64_t n = Count(ndims[0], shapes[0]);
  if (Count(ndims[1], shapes[1]) != n || Count(ndims[2], shapes[2]) != n) return 1;
  const float *dy = In(params, 0), *g = In(params, 1), *u = In(params, 2);
  float *dg = Out(params, 3), *du = Out(params, 4);
  ParallelElements(n, [&](int64_t k0, int64_t k1) {
    for (int64_t k = k0; k < k1; ++k) {
      const float s = Sigmoid(g[k]);
      du[k] = dy[k] * (g[k] * s);
      dg[k] = (dy[k] * u[k]) * (s * (1.0f + g[k] * (1.0f - s)));
    }
  });
  return 0;
}

// The head's cross entropy and its gradient in one pass over each row (naohai.model.head_loss, fused):
// logits x [r, V], labels int32 [r] (each in [0, V)), weight w [r] or [1] (one for every row) -> nll [r], the
// rows' log(sum_k exp(x_k - m)) - (x_y - m) with m the row's maximum, and g [r, V] = w_i * (softmax(x_i) -
// onehot(y_i)), the gradient of sum_i w_i * nll_i with respect to x.  The exps are written to g and summed
// (ExpSum), then scaled in place: each row is read once from memory.
int NaohaiSoftmaxCrossEntropy(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *,
                              void *) {
  if (nparam != 5 || ndims[0] != 2 || std::strcmp(dtypes[1], "int32") != 0) return 1;
  const int64_t rows = shapes[0][0], v = shapes[0][1], nw = Count(ndims[2], shapes[2]);
  if (Count(ndims[1], shapes[1]) != rows || (nw != rows && nw != 1)) return 1;
  const float *x = In(params, 0), *w = In(params, 2);
  const int32_t *labels = static_cast<const int32_t *>(params[1]);
  for (int64_t r = 0; r < rows; ++r)
    if (labels[r] < 0 || labels[r] >= v) return 1;
  float *nll = Out(params, 3), *g = Out(params, 4);
  ParallelRows(rows, v, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float *xr = x + r * v;
      float *gr = g + r * v;
      float m = -INFINITY;
#pragma omp simd reduction(max : m)
      for (int64_t k = 0; k < v; ++k) m = xr[k] > m ? xr[k] : m;
      const float sum = ExpSum(xr, m, v, gr);
      const int32_t y = labels[r];
      nll[r] = std::log(sum) - (xr[y] - m);
      const float wr = w[nw == 1 ? 0 : r], f = wr / sum;
      for (int64_t k = 0; k < v; ++k) gr[k] = gr[k] * f;
      gr[y] = gr[y] - wr;
    }
  });
  return 0;
}

// AdamW's update of every trained parameter by one kernel, in place (the optimizer of a fused CPU step:
// naohai.train.adam_all).  Inputs p_0..p_{n-1}, m_0.., v_0.., g_0.. (parameters, first and second moments,
// gradients), lr [1], beta1 [1], beta2 [1], eps [1], decay [n] (each parameter's weight decay, 0 for those that do
// not decay), scale [1] (the clip's factor), go [1] (the step's guard: 0 leaves everything as it is); output [1]
// (0).  p, m and v are written where they lie (the primitive is marked as writing memory): with g = g * scale (the
// clip's product, as Mul computes it), m += (g - m) * (1 - beta1), v += (g * g - v) * (1 - beta2),
// p -= lr * (m / (sqrt(v) + eps) + decay * p), the update of MindSpore's AdamWeightDecay (no bias correction).
// Its CPU kernel's results differ from these in the last bit for a third of the elements of m and v (its vector
// path and thread split, not reproduced here).  The loop is vectorized (FLAGS' -fno-math-errno lets sqrt be the
// vector instruction, which rounds as the scalar one does).
int NaohaiAdamWeightDecayAll(int nparam, void **params, int *ndims, int64_t **shapes, const char **, void *, void *) {
  if (nparam < 12 || (nparam - 8) % 4 != 0) return 1;
  const int n = (nparam - 8) / 4, s = 4 * n;
  for (int i = s; i < s + 4; ++i)
    if (Count(ndims[i], shapes[i]) != 1) return 1;
  if (Count(ndims[s + 4], shapes[s + 4]) != n || Count(ndims[s + 5], shapes[s + 5]) != 1 ||
      Count(ndims[s + 6], shapes[s + 6]) != 1)
    return 1;
  for (int i = 0; i < n; ++i) {
    const int64_t count = Count(ndims[i], shapes[i]);
    for (int j = 1; j < 4; ++j)
      if (Count(ndims[i + j * n], shapes[i + j * n]) != count) return 1;
  }
  *Out(params, s + 7) = 0.0f;
  if (*In(params, s + 6) == 0.0f) return 0;
  const float lr = *In(params, s), beta1 = *In(params, s + 1), beta2 = *In(params, s + 2), eps = *In(params, s + 3);
  const float *decay = In(params, s + 4);
  const float scale = *In(params, s + 5);
  const float beta1_minus = 1.0f - beta1, beta2_minus = 1.0f - beta2;
  std::vector<int64_t> start(n + 1, 0);          // the parameters' elements one after another
  for (int i = 0; i < n; ++i) start[i + 1] = start[i] + Count(ndims[i], shapes[i]);
  ParallelElements(start[n], [&](int64_t e0, int64_t e1) {
    for (int i = 0; i < n; ++i) {
      const int64_t k0 = std::max(e0, start[i]) - start[i], k1 = std::min(e1, start[i + 1]) - start[i];
      if (k0 >= k1) continue;
      float *__restrict p = Out(params, i), *__restrict m = Out(params, n + i), *__restrict v = Out(params, 2 * n + i);
      const float *__restrict g = In(params, 3 * n + i);
      const float d = decay[i];
      for (int64_t k = k0; k < k1; ++k) {
        const float gk = g[k] * scale;
        m[k] += (gk - m[k]) * beta1_minus;
        v[k] += (gk * gk - v[k]) * beta2_minus;
        p[k] -= lr * (m[k] / (std::sqrt(v[k]) + eps) + d * p[k]);
      }
    }
  });
  return 0;
}
}
