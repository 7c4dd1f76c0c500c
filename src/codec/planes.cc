#include "codec/planes.hpp"

#include <algorithm>
#include <cstring>
#include <queue>
#include <vector>

#include "base/util.hpp"
#include "codec/codec.hpp"

namespace ferry::planes {
namespace {

inline uint32_t Load32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
inline uint16_t Load16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}
inline void Store32(uint8_t* p, uint32_t v) { std::memcpy(p, &v, 4); }
inline void Store16(uint8_t* p, uint16_t v) { std::memcpy(p, &v, 2); }

inline uint32_t Reverse(uint32_t code, int len) {
  uint32_t r = 0;
  for (int i = 0; i < len; ++i) r |= ((code >> i) & 1u) << (len - 1 - i);
  return r;
}

inline size_t Align16(size_t v) { return (v + 15) & ~size_t{15}; }

// Moves `pos` to the next 16-byte boundary, zeroing the bytes it skips: `out` is usually a
// reused buffer, and stale bytes there would make the stored block depend on what it held
// before (which worker encoded it) and carry bytes of other blocks into the file.
inline size_t ZeroPad16(uint8_t* out, size_t pos) {
  const size_t end = Align16(pos);
  std::memset(out + pos, 0, end - pos);
  return end;
}

uint32_t UnitSymbols(uint32_t sps) { return kStreamsPerUnit * sps; }

// Stream codes in the order the stream stores them: bit-reversed canonical codes, so the
// decoder reads the stream least significant bit first and indexes its table directly.
void CanonicalCodes(const uint8_t lengths[256], uint32_t rcode[256]) {
  uint32_t count[kMaxCodeLength + 2] = {};
  for (int s = 0; s < 256; ++s) count[lengths[s]]++;
  count[0] = 0;
  uint32_t next[kMaxCodeLength + 2] = {};
  uint32_t code = 0;
  for (int l = 1; l <= kMaxCodeLength; ++l) {
    code = (code + count[l - 1]) << 1;
    next[l] = code;
  }
  for (int s = 0; s < 256; ++s) {
    int l = lengths[s];
    rcode[s] = l ? Reverse(next[l]++, l) : 0;
  }
}

// Table indexed by the next max_len stream bits: symbol << 4 | length, 0 where no code
// matches (an incomplete code), which the decoders report as corruption.
void BuildTable(const uint8_t lengths[256], int max_len, uint16_t* table) {
  std::memset(table, 0, sizeof(uint16_t) << max_len);
  uint32_t rcode[256];
  CanonicalCodes(lengths, rcode);
  for (int s = 0; s < 256; ++s) {
    int l = lengths[s];
    if (l == 0) continue;
    for (uint32_t j = 0; j < (1u << (max_len - l)); ++j) {
      table[rcode[s] | (j << l)] = static_cast<uint16_t>(s << 4 | l);
    }
  }
}

void HuffmanDepths(const uint64_t freq[256], uint8_t lengths[256]) {
  std::memset(lengths, 0, 256);
  int used = 0, only = 0;
  for (int s = 0; s < 256; ++s) {
    if (freq[s]) ++used, only = s;
  }
  if (used == 0) return;
  if (used == 1) {
    lengths[only] = 1;
    return;
  }
  // Nodes 0..255 are leaves; internal nodes follow. Ties break on the node index so the
  // result is deterministic.
  int parent[512];
  using Item = std::pair<uint64_t, int>;
  std::priority_queue<Item, std::vector<Item>, std::greater<Item>> q;
  for (int s = 0; s < 256; ++s) {
    if (freq[s]) q.push({freq[s], s});
  }
  int next = 256;
  while (q.size() > 1) {
    Item a = q.top();
    q.pop();
    Item b = q.top();
    q.pop();
    parent[a.second] = next;
    parent[b.second] = next;
    q.push({a.first + b.first, next});
    ++next;
  }
  int root = next - 1;
  uint8_t depth[512];
  depth[root] = 0;
  for (int n = root - 1; n >= 256; --n) depth[n] = static_cast<uint8_t>(depth[parent[n]] + 1);
  for (int s = 0; s < 256; ++s) {
    if (freq[s]) {
      int d = depth[parent[s]] + 1;
      lengths[s] = static_cast<uint8_t>(std::min(d, 255));
    }
  }
}

struct Table {
  uint16_t entry[1 << kMaxCodeLength];
};

// Decoder state of one stream after its symbols: what the end-of-stream checks look at.
struct StreamEnd {
  const uint8_t* w;
  uint64_t buf;
  int nb;
  uint32_t bad;
};

// Decodes K streams of `nsym` symbols each in lockstep: their table lookups are independent,
// so the CPU overlaps K dependency chains instead of waiting on one. Before each pair of codes
// a stream holds at least 32 bits unless its words ran out; a stream that ends early drives
// its bit count negative, and a code no symbol has marks it bad (both checked afterwards).
template <int K>
inline void DecodeLockstep(const uint8_t* const* start, const uint8_t* const* wend,
                           uint8_t* const* out, uint32_t nsym, const uint16_t* table, uint32_t mask,
                           StreamEnd* end) {
  uint64_t buf[K];
  int nb[K];
  const uint8_t* w[K];
  uint32_t bad[K];
  for (int k = 0; k < K; ++k) buf[k] = 0, nb[k] = 0, w[k] = start[k], bad[k] = 0;
  uint32_t i = 0;
  for (; i + 2 <= nsym; i += 2) {
#pragma GCC unroll 4
    for (int k = 0; k < K; ++k) {
      if (nb[k] < 32 && w[k] < wend[k]) {
        buf[k] |= uint64_t{Load32(w[k])} << nb[k];
        w[k] += 4;
        nb[k] += 32;
      }
      const uint32_t e0 = table[buf[k] & mask], l0 = e0 & 15;
      buf[k] >>= l0;
      const uint32_t e1 = table[buf[k] & mask], l1 = e1 & 15;
      buf[k] >>= l1;
      nb[k] -= static_cast<int>(l0 + l1);
      bad[k] |= (l0 == 0) | (l1 == 0);
      out[k][i] = static_cast<uint8_t>(e0 >> 4);
      out[k][i + 1] = static_cast<uint8_t>(e1 >> 4);
    }
  }
  if (i < nsym) {
    for (int k = 0; k < K; ++k) {
      if (nb[k] < 32 && w[k] < wend[k]) {
        buf[k] |= uint64_t{Load32(w[k])} << nb[k];
        w[k] += 4;
        nb[k] += 32;
      }
      const uint32_t e = table[buf[k] & mask], l = e & 15;
      buf[k] >>= l;
      nb[k] -= static_cast<int>(l);
      bad[k] |= l == 0;
      out[k][i] = static_cast<uint8_t>(e >> 4);
    }
  }
  for (int k = 0; k < K; ++k) end[k] = StreamEnd{w[k], buf[k], nb[k], bad[k]};
}

Status DecodeUnitStreams(const uint8_t* unit, uint32_t usize, const uint16_t* table, int max_len,
                         uint32_t first, uint32_t count, uint32_t sps, uint8_t* out, uint32_t u,
                         uint32_t k) {
  if (usize < kStreamsPerUnit) {
    return Error(StatusCode::kDataLoss, "unit ", u, " of plane ", k, ": ", usize,
                 " bytes, less than its stream length table");
  }
  uint64_t total = kStreamsPerUnit;
  for (uint32_t t = 0; t < kStreamsPerUnit; ++t) total += 4u * unit[t];
  if (total != usize) {
    return Error(StatusCode::kDataLoss, "unit ", u, " of plane ", k, ": streams hold ", total,
                 " bytes, the unit ", usize);
  }
  const uint32_t mask = (1u << max_len) - 1;
  const uint8_t* start[kStreamsPerUnit];
  const uint8_t* wend[kStreamsPerUnit];
  uint8_t* o[kStreamsPerUnit];
  uint32_t nsym[kStreamsPerUnit];
  const uint8_t* p = unit + kStreamsPerUnit;
  for (uint32_t t = 0; t < kStreamsPerUnit; ++t) {
    const uint64_t s0 = uint64_t{first} + uint64_t{t} * sps;
    nsym[t] = s0 >= count ? 0 : static_cast<uint32_t>(std::min<uint64_t>(sps, count - s0));
    start[t] = p;
    p += 4 * unit[t];
    wend[t] = p;
    o[t] = out + (nsym[t] ? s0 : 0);
  }
  StreamEnd end[kStreamsPerUnit];
  for (uint32_t t = 0; t < kStreamsPerUnit;) {
    if (t + 4 <= kStreamsPerUnit && nsym[t] == nsym[t + 3]) {  // nsym never increases with t
      DecodeLockstep<4>(start + t, wend + t, o + t, nsym[t], table, mask, end + t);
      t += 4;
    } else {
      DecodeLockstep<1>(start + t, wend + t, o + t, nsym[t], table, mask, end + t);
      t += 1;
    }
  }
  for (uint32_t t = 0; t < kStreamsPerUnit; ++t) {
    const StreamEnd& e = end[t];
    if (e.bad || e.nb < 0) {
      return Error(StatusCode::kDataLoss, "unit ", u, " of plane ", k, ", stream ", t,
                   ": invalid code or stream ends early");
    }
    // Exactly the words the codes need, and zero padding after the last code.
    if (e.w != wend[t] || e.buf != 0 || e.nb >= 32 || (nsym[t] == 0 && unit[t] != 0)) {
      return Error(StatusCode::kDataLoss, "unit ", u, " of plane ", k, ", stream ", t,
                   ": stream length or padding does not match its ", nsym[t], " codes");
    }
  }
  return Status::Ok();
}

}  // namespace

size_t Bound(size_t raw) { return raw + kHeaderSize + 16 * (kMaxWidth + 2); }

void BuildLengths(const uint64_t freq[256], int max_len, uint8_t lengths[256]) {
  uint64_t f[256];
  std::memcpy(f, freq, sizeof(f));
  for (;;) {
    HuffmanDepths(f, lengths);
    int longest = *std::max_element(lengths, lengths + 256);
    if (longest <= max_len) return;
    // Flatten the distribution and rebuild: rare symbols gain probability, common ones keep
    // their ratios. Converges: at worst every used symbol has weight 1 (8-bit codes).
    for (int s = 0; s < 256; ++s) {
      if (f[s]) f[s] = (f[s] + 1) / 2;
    }
  }
}

size_t Encode(const uint8_t* raw, size_t n, size_t width, uint8_t* out, uint8_t* scratch,
              double min_savings) {
  if (n == 0 || n > UINT32_MAX - Bound(0) ||
      (width != 1 && width != 2 && width != 4 && width != 8)) {
    return 0;
  }
  const uint32_t count = static_cast<uint32_t>(n / width);
  const uint32_t sps = kSymbolsPerStream;
  const uint32_t usyms = UnitSymbols(sps);
  const uint32_t nunits = (count + usyms - 1) / usyms;
  Shuffle(raw, scratch, n, width);
  std::memset(out, 0, kHeaderSize);
  out[0] = 'T';
  out[1] = 'F';
  out[2] = 'P';
  out[3] = kVersion;
  out[4] = static_cast<uint8_t>(width);
  out[5] = kStreamsPerUnit;
  Store16(out + 6, static_cast<uint16_t>(sps));
  Store32(out + 8, static_cast<uint32_t>(n));
  Store32(out + 12, count);
  size_t pos = kHeaderSize;
  const size_t budget = min_savings < 0
                            ? SIZE_MAX
                            : static_cast<size_t>(static_cast<double>(n) * (1.0 - min_savings));
  std::vector<uint32_t> words;
  for (size_t k = 0; k < width; ++k) {
    const uint8_t* plane = scratch + k * count;
    pos = ZeroPad16(out, pos);
    uint8_t* sec = out + pos;
    bool coded = false;
    uint32_t size = count;
    if (count > 0) {
      uint64_t freq[256] = {};
      for (uint32_t i = 0; i < count; ++i) freq[plane[i]]++;
      uint8_t lengths[256];
      BuildLengths(freq, kMaxCodeLength, lengths);
      uint64_t bits = 0;
      for (int s = 0; s < 256; ++s) bits += freq[s] * lengths[s];
      // Lengths table, unit table, per-unit stream lengths and about half a word of padding
      // per stream.
      uint64_t estimate = bits / 8 + kCodedUnitTableOffset + 4 * (nunits + 1) +
                          uint64_t{nunits} * (kStreamsPerUnit + 2 * kStreamsPerUnit);
      if (estimate < uint64_t{count} * 97 / 100) {
        int max_len = *std::max_element(lengths, lengths + 256);
        uint32_t rcode[256];
        CanonicalCodes(lengths, rcode);
        sec[0] = static_cast<uint8_t>(max_len);
        sec[1] = sec[2] = sec[3] = 0;
        Store32(sec + 4, nunits);
        for (int s = 0; s < 256; s += 2) {
          sec[kCodedLengthsOffset + s / 2] = static_cast<uint8_t>(lengths[s] | lengths[s + 1] << 4);
        }
        uint8_t* table = sec + kCodedUnitTableOffset;
        size_t upos = kCodedUnitTableOffset + 4 * (size_t{nunits} + 1);
        // A coded plane is abandoned as soon as it would outgrow the raw plane.
        const size_t limit = count;
        bool fits = true;
        for (uint32_t u = 0; u < nunits && fits; ++u) {
          Store32(table + 4 * u, static_cast<uint32_t>(upos));
          if (upos + kStreamsPerUnit > limit) {
            fits = false;
            break;
          }
          uint8_t* unit = sec + upos;
          uint8_t* dstw = unit + kStreamsPerUnit;
          for (uint32_t t = 0; t < kStreamsPerUnit; ++t) {
            uint64_t s0 = uint64_t{u} * usyms + uint64_t{t} * sps;
            uint32_t nsym =
                s0 >= count ? 0 : static_cast<uint32_t>(std::min<uint64_t>(sps, count - s0));
            // Worst case of this stream: nsym codes of max_len bits.
            if (static_cast<size_t>(dstw - sec) + (nsym * size_t{kMaxCodeLength} + 31) / 32 * 4 >
                limit) {
              fits = false;
              break;
            }
            uint64_t acc = 0;
            int nb = 0;
            uint32_t nw = 0;
            for (uint32_t i = 0; i < nsym; ++i) {
              uint8_t s = plane[s0 + i];
              acc |= uint64_t{rcode[s]} << nb;
              nb += lengths[s];
              if (nb >= 32) {
                Store32(dstw, static_cast<uint32_t>(acc));
                dstw += 4;
                ++nw;
                acc >>= 32;
                nb -= 32;
              }
            }
            if (nb > 0) {
              Store32(dstw, static_cast<uint32_t>(acc));
              dstw += 4;
              ++nw;
            }
            unit[t] = static_cast<uint8_t>(nw);
          }
          upos = static_cast<size_t>(dstw - sec);
        }
        if (fits && upos < limit) {
          Store32(table + 4 * size_t{nunits}, static_cast<uint32_t>(upos));
          coded = true;
          size = static_cast<uint32_t>(upos);
        }
      }
    }
    if (!coded) std::memcpy(sec, plane, count);
    out[16 + k] = coded ? kPlaneHuffman : kPlaneRaw;
    Store32(out + 32 + 8 * k, static_cast<uint32_t>(pos));
    Store32(out + 36 + 8 * k, size);
    pos += size;
    if (pos > budget) return 0;
  }
  const size_t tail = n - size_t{count} * width;
  pos = ZeroPad16(out, pos);
  Store32(out + 24, static_cast<uint32_t>(pos));
  if (tail) std::memcpy(out + pos, scratch + size_t{count} * width, tail);
  pos += tail;
  if (pos > budget) return 0;
  return pos;
}

Status Parse(const uint8_t* src, size_t n, size_t raw_size, Layout* out) {
  Layout l;
  if (n < kHeaderSize) {
    return Error(StatusCode::kDataLoss, "planes block of ", n, " bytes is shorter than its ",
                 kHeaderSize, "-byte header");
  }
  if (src[0] != 'T' || src[1] != 'F' || src[2] != 'P') {
    return Error(StatusCode::kDataLoss, "planes block lacks its \"TFP\" magic");
  }
  if (src[3] != kVersion) {
    return Error(StatusCode::kDataLoss, "planes block version ", int{src[3]}, " (this build reads ",
                 int{kVersion}, ")");
  }
  l.width = src[4];
  l.symbols_per_stream = Load16(src + 6);
  l.raw_size = Load32(src + 8);
  l.count = Load32(src + 12);
  l.tail_offset = Load32(src + 24);
  if (l.width != 1 && l.width != 2 && l.width != 4 && l.width != 8) {
    return Error(StatusCode::kDataLoss, "planes block element width ", l.width);
  }
  if (src[5] != kStreamsPerUnit) {
    return Error(StatusCode::kDataLoss, "planes block with ", int{src[5]},
                 " streams per unit (expected ", kStreamsPerUnit, ")");
  }
  if (l.symbols_per_stream == 0 || l.symbols_per_stream > kMaxSymbolsPerStream ||
      l.symbols_per_stream % 8 != 0) {
    return Error(StatusCode::kDataLoss, "planes block with ", l.symbols_per_stream,
                 " symbols per stream");
  }
  if (l.raw_size != raw_size || l.count != raw_size / l.width) {
    return Error(StatusCode::kDataLoss, "planes block claims ", l.raw_size, " bytes in ", l.count,
                 " elements; the block holds ", raw_size, " bytes");
  }
  if (Load32(src + 28) != 0) return Error(StatusCode::kDataLoss, "planes block reserved field set");
  l.tail_size = l.raw_size - l.count * l.width;
  const uint32_t usyms = UnitSymbols(l.symbols_per_stream);
  l.nunits = static_cast<uint32_t>((uint64_t{l.count} + usyms - 1) / usyms);
  uint64_t prev_end = kHeaderSize;
  for (uint32_t k = 0; k < kMaxWidth; ++k) {
    Layout::Plane& p = l.plane[k];
    p.mode = src[16 + k];
    p.offset = Load32(src + 32 + 8 * k);
    p.size = Load32(src + 36 + 8 * k);
    if (k >= l.width) {
      if (p.mode != 0 || p.offset != 0 || p.size != 0) {
        return Error(StatusCode::kDataLoss, "planes block describes plane ", k, " of a ", l.width,
                     "-byte element");
      }
      continue;
    }
    if (p.offset % 16 != 0 || p.offset < prev_end || uint64_t{p.offset} + p.size > n) {
      return Error(StatusCode::kDataLoss, "plane ", k, " at [", p.offset, ", ",
                   uint64_t{p.offset} + p.size, ") is misaligned, overlaps or runs past the ", n,
                   "-byte block");
    }
    prev_end = uint64_t{p.offset} + p.size;
    const uint8_t* sec = src + p.offset;
    if (p.mode == kPlaneRaw) {
      if (p.size != l.count) {
        return Error(StatusCode::kDataLoss, "raw plane ", k, " holds ", p.size, " bytes for ",
                     l.count, " elements");
      }
    } else if (p.mode == kPlaneHuffman) {
      if (l.count == 0 || p.size < kCodedUnitTableOffset + 4 * (uint64_t{l.nunits} + 1)) {
        return Error(StatusCode::kDataLoss, "coded plane ", k, " of ", p.size,
                     " bytes is too short for its tables");
      }
      p.max_len = sec[0];
      if (p.max_len < 1 || p.max_len > kMaxCodeLength || sec[1] || sec[2] || sec[3]) {
        return Error(StatusCode::kDataLoss, "coded plane ", k, ": maximum code length ",
                     int{p.max_len});
      }
      if (Load32(sec + 4) != l.nunits) {
        return Error(StatusCode::kDataLoss, "coded plane ", k, ": ", Load32(sec + 4),
                     " units, expected ", l.nunits);
      }
      uint64_t kraft = 0;
      int longest = 0;
      for (int s = 0; s < 256; ++s) {
        int len = (sec[kCodedLengthsOffset + s / 2] >> (4 * (s & 1))) & 15;
        if (len > p.max_len) {
          return Error(StatusCode::kDataLoss, "coded plane ", k, ": symbol ", s, " has a ", len,
                       "-bit code, longer than the plane's maximum ", int{p.max_len});
        }
        if (len) kraft += uint64_t{1} << (kMaxCodeLength - len);
        longest = std::max(longest, len);
      }
      if (longest != p.max_len || kraft > (uint64_t{1} << kMaxCodeLength)) {
        return Error(StatusCode::kDataLoss, "coded plane ", k,
                     ": code lengths do not form a prefix code");
      }
      const uint8_t* table = sec + kCodedUnitTableOffset;
      uint64_t first = kCodedUnitTableOffset + 4 * (uint64_t{l.nunits} + 1);
      if (Load32(table) != first || Load32(table + 4 * uint64_t{l.nunits}) != p.size) {
        return Error(StatusCode::kDataLoss, "coded plane ", k,
                     ": unit table does not span the plane");
      }
      for (uint32_t u = 0; u < l.nunits; ++u) {
        uint32_t a = Load32(table + 4 * uint64_t{u}), b = Load32(table + 4 * (uint64_t{u} + 1));
        if (b < a || b - a < kStreamsPerUnit || (b - a) % 4 != 0) {
          return Error(StatusCode::kDataLoss, "unit ", u, " of plane ", k, " at [", a, ", ", b,
                       ") has an impossible extent");
        }
      }
      ++l.coded_planes;
    } else {
      return Error(StatusCode::kDataLoss, "plane ", k, " has unknown mode ", int{p.mode});
    }
  }
  if (l.tail_offset % 16 != 0 || l.tail_offset < prev_end ||
      uint64_t{l.tail_offset} + l.tail_size > n) {
    return Error(StatusCode::kDataLoss, "planes block tail at ", l.tail_offset,
                 " is misaligned or outside the block");
  }
  *out = l;
  return Status::Ok();
}

Status DecodeParsed(const uint8_t* src, const Layout& l, uint8_t* dst, uint8_t* scratch) {
  // One element width: the planes are the element bytes, decode straight into dst.
  uint8_t* planes = l.width == 1 ? dst : scratch;
  thread_local Table table;
  const uint32_t usyms = UnitSymbols(l.symbols_per_stream);
  for (uint32_t k = 0; k < l.width; ++k) {
    const Layout::Plane& p = l.plane[k];
    const uint8_t* sec = src + p.offset;
    uint8_t* plane = planes + size_t{k} * l.count;
    if (p.mode == kPlaneRaw) {
      if (l.count) std::memcpy(plane, sec, l.count);
      continue;
    }
    uint8_t lengths[256];
    for (int s = 0; s < 256; ++s) {
      lengths[s] = (sec[kCodedLengthsOffset + s / 2] >> (4 * (s & 1))) & 15;
    }
    BuildTable(lengths, p.max_len, table.entry);
    const uint8_t* utable = sec + kCodedUnitTableOffset;
    for (uint32_t u = 0; u < l.nunits; ++u) {
      uint32_t a = Load32(utable + 4 * size_t{u}), b = Load32(utable + 4 * (size_t{u} + 1));
      FERRY_RETURN_IF_ERROR(DecodeUnitStreams(sec + a, b - a, table.entry, p.max_len, u * usyms,
                                              l.count, l.symbols_per_stream, plane, u, k));
    }
  }
  if (l.width == 1) {
    if (l.tail_size) std::memcpy(dst + l.count, src + l.tail_offset, l.tail_size);
    return Status::Ok();
  }
  if (l.tail_size) {
    std::memcpy(scratch + size_t{l.count} * l.width, src + l.tail_offset, l.tail_size);
  }
  Unshuffle(scratch, dst, l.raw_size, l.width);
  return Status::Ok();
}

Status Decode(const uint8_t* src, size_t n, uint8_t* dst, size_t raw_size, uint8_t* scratch) {
  Layout l;
  FERRY_RETURN_IF_ERROR(Parse(src, n, raw_size, &l));
  return DecodeParsed(src, l, dst, scratch);
}

}  // namespace ferry::planes
