#include "server/checkpoint.h"

#include <algorithm>
#include <cstring>
#include <set>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"
#include "common/clock.h"
#include "common/file_format.h"
#include "common/status.h"
#include "glog/logging.h"

namespace pstrain::server {
namespace {

constexpr char kMagic[4] = {'P', 'S', 'C', 'K'};
constexpr uint32_t kFormatVersion = 1;
constexpr char kSuffix[] = ".ckpt";
constexpr char kTempSuffix[] = ".ckpt.tmp";
// The largest header accepted: far above any real plan's.
constexpr uint32_t kMaxHeaderBytes = 256 << 20;

// step and generation of "step-SSSSSSSSSSSS.gG.ckpt".
bool ParseName(absl::string_view name, v1::CheckpointRecord* record) {
  if (!absl::ConsumePrefix(&name, "step-") || !absl::ConsumeSuffix(&name, kSuffix)) return false;
  const size_t dot = name.find(".g");
  if (dot == absl::string_view::npos) return false;
  int64_t step, generation;
  if (!absl::SimpleAtoi(name.substr(0, dot), &step) ||
      !absl::SimpleAtoi(name.substr(dot + 2), &generation)) {
    return false;
  }
  record->set_step(step);
  record->set_generation(generation);
  return true;
}

// n floats stored at bytes[at...] (not aligned). No copy at all for none
// (an empty vector's data() may be null, which memcpy must not get).
std::vector<float> FloatsAt(const std::string& bytes, size_t at, int64_t n) {
  std::vector<float> floats(n);
  if (n > 0) std::memcpy(floats.data(), bytes.data() + at, n * sizeof(float));
  return floats;
}

constexpr size_t kFlushBytes = 1 << 20;

// A table's part of the file: its rows, the keys deleted, then its
// filter's counters; a megabyte at a time.
absl::Status WriteTable(const TableCheckpoint& table, ChecksummedWriter& out) {
  std::string& b = out.buffer();
  auto put_row = [&](const SparseTable::Row& row) {
    PutU64(b, row.key);
    PutU64(b, static_cast<uint64_t>(row.last_step));
    PutU64(b, static_cast<uint64_t>(row.touches));
    PutU64(b, static_cast<uint64_t>(row.updates));
    b.append(reinterpret_cast<const char*>(row.values.data()), 4 * row.values.size());
    b.append(reinterpret_cast<const char*>(row.state.data()), 4 * row.state.size());
    return out.Flush(kFlushBytes);
  };
  if (table.live.has_value()) {
    int64_t written = 0;
    PSTRAIN_RETURN_IF_ERROR(table.live->read([&](const SparseTable::Row& row) {
      ++written;
      return put_row(row);
    }));
    if (written != table.live->count) {
      return absl::InternalError(
          absl::StrCat("table ", table.index, " gave ", written, " rows, not ", table.live->count));
    }
  } else {
    for (const SparseTable::Row& row : table.rows) PSTRAIN_RETURN_IF_ERROR(put_row(row));
  }
  for (uint64_t key : table.deleted) PutU64(b, key);
  for (uint16_t counter : table.filter.counters) {
    b.push_back(static_cast<char>(counter & 0xff));
    b.push_back(static_cast<char>(counter >> 8));
  }
  return out.Flush(kFlushBytes);
}

// Reads the header of a checkpoint file from its start (no CRC check:
// pruning's view of a file, and the row reader's, which checked it).
absl::StatusOr<v1::CheckpointHeader> ReadHeaderFrom(ReadableFile& file, const std::string& path) {
  auto unreadable = [&] {
    return absl::DataLossError(absl::StrCat("checkpoint ", path, " has no readable header"));
  };
  PSTRAIN_ASSIGN_OR_RETURN(const std::string head, file.Read(12));
  if (head.size() < 12 || std::memcmp(head.data(), kMagic, sizeof(kMagic)) != 0 ||
      GetU32(head, 4) != kFormatVersion || GetU32(head, 8) > kMaxHeaderBytes) {
    return unreadable();
  }
  PSTRAIN_ASSIGN_OR_RETURN(const std::string bytes, file.Read(GetU32(head, 8)));
  v1::CheckpointHeader header;
  if (bytes.size() != GetU32(head, 8) || !header.ParseFromString(bytes)) return unreadable();
  return header;
}

absl::StatusOr<v1::CheckpointHeader> ReadHeader(FileSystem* fs, const std::string& path) {
  PSTRAIN_ASSIGN_OR_RETURN(std::unique_ptr<ReadableFile> file, fs->OpenForRead(path));
  return ReadHeaderFrom(*file, path);
}

// `delta`'s rows and deletions applied to `base`'s rows (both by key).
void MergeRows(TableCheckpoint& base, TableCheckpoint& delta) {
  std::vector<SparseTable::Row> merged;
  merged.reserve(base.rows.size() + delta.rows.size());
  auto changed = delta.rows.begin();
  for (SparseTable::Row& row : base.rows) {
    while (changed != delta.rows.end() && changed->key < row.key)
      merged.push_back(std::move(*changed++));
    if (changed != delta.rows.end() && changed->key == row.key) continue;  // changed: it comes next
    if (std::binary_search(delta.deleted.begin(), delta.deleted.end(), row.key)) continue;
    merged.push_back(std::move(row));
  }
  while (changed != delta.rows.end()) merged.push_back(std::move(*changed++));
  delta.rows = std::move(merged);
  delta.deleted.clear();
}

}  // namespace

std::string CheckpointDirOf(const std::string& dir, const std::string& job_id, uint32_t server) {
  return absl::StrCat(dir, "/", job_id, "/server-", server);
}

std::string CheckpointPath(const std::string& dir, const std::string& job_id, uint32_t server,
                           int64_t step, int64_t generation) {
  return absl::StrFormat("%s/step-%012d.g%d%s", CheckpointDirOf(dir, job_id, server), step,
                         generation, kSuffix);
}

absl::StatusOr<int64_t> WriteCheckpoint(FileSystem* fs, const std::string& dir,
                                        const ServerCheckpoint& c) {
  const std::string parent = CheckpointDirOf(dir, c.job_id, c.server_index);
  PSTRAIN_RETURN_IF_ERROR(fs->MakeDirs(parent));
  const std::string path = CheckpointPath(dir, c.job_id, c.server_index, c.step, c.generation);
  const std::string tmp = path + ".tmp";
  if (c.base_step != 0) {
    const std::string base =
        CheckpointPath(dir, c.job_id, c.server_index, c.base_step, c.base_generation);
    if (!fs->Exists(base)) {
      return absl::FailedPreconditionError(absl::StrCat("incremental checkpoint of step ", c.step,
                                                        " not written: its base ", base,
                                                        " is not on disk"));
    }
  }

  v1::CheckpointHeader header;
  header.set_job_id(c.job_id);
  header.set_server_index(c.server_index);
  header.set_num_servers(c.num_servers);
  header.set_step(c.step);
  header.set_generation(c.generation);
  header.set_total_floats(c.total_floats);
  header.set_base_step(c.base_step);
  header.set_base_generation(c.base_generation);
  for (const ChunkCheckpoint& chunk : c.chunks) {
    v1::CheckpointHeader::Chunk* h = header.add_chunks();
    h->set_id(chunk.id);
    h->set_size(static_cast<int64_t>(chunk.values.size()));
    h->set_version(chunk.version);
    h->set_state_floats(static_cast<int64_t>(chunk.state.size()));
  }
  for (const TableCheckpoint& table : c.tables) {
    v1::CheckpointHeader::Table* h = header.add_tables();
    h->set_index(table.index);
    h->set_dim(table.dim);
    h->set_state_floats(table.state_floats);
    h->set_rows(table.row_count());
    h->set_filter_counters(static_cast<int64_t>(table.filter.counters.size()));
    h->set_filter_ages(true);
    h->set_filter_current(table.filter.current);
    h->set_filter_current_sightings(table.filter.current_sightings);
    h->set_version(table.version);
    h->set_deleted(static_cast<int64_t>(table.deleted.size()));
  }
  std::string head(kMagic, sizeof(kMagic));
  PutU32(head, kFormatVersion);
  const std::string header_bytes = header.SerializeAsString();
  PutU32(head, static_cast<uint32_t>(header_bytes.size()));
  head += header_bytes;

  PSTRAIN_ASSIGN_OR_RETURN(std::unique_ptr<WritableFile> file, fs->OpenForAppend(tmp, true));
  uint32_t crc = Crc32(head.data(), head.size());
  absl::Status s = file->Append(head);
  for (const ChunkCheckpoint& chunk : c.chunks) {
    for (const std::vector<float>* floats : {&chunk.values, &chunk.state}) {
      if (!s.ok()) break;
      const size_t bytes = floats->size() * sizeof(float);
      crc = Crc32(floats->data(), bytes, crc);
      s = file->Append(absl::string_view(reinterpret_cast<const char*>(floats->data()), bytes));
    }
  }
  ChecksummedWriter tables(file.get(), crc);
  for (const TableCheckpoint& table : c.tables) {
    if (s.ok()) s = WriteTable(table, tables);
  }
  if (s.ok()) s = tables.Flush();
  std::string trailer;
  PutU32(trailer, tables.crc());
  if (s.ok()) s = file->Append(trailer);
  if (s.ok()) s = file->Sync();
  const int64_t size = file->Size();
  if (s.ok()) s = file->Close();
  if (s.ok()) s = fs->Rename(tmp, path);
  if (s.ok()) s = fs->SyncDir(parent);
  if (!s.ok()) {
    file.reset();
    fs->Remove(tmp).IgnoreError();
    return s;
  }
  return size;
}

absl::StatusOr<ServerCheckpoint> ReadCheckpoint(FileSystem* fs, const std::string& path) {
  absl::StatusOr<std::string> read = fs->ReadFile(path);
  if (!read.ok()) {
    if (read.status().code() == absl::StatusCode::kNotFound) return read.status();
    return absl::DataLossError(absl::StrCat("checkpoint ", path, ": ", read.status().message()));
  }
  const std::string& bytes = *read;
  auto damaged = [&](absl::string_view why) {
    return absl::DataLossError(absl::StrCat("checkpoint ", path, " is damaged: ", why));
  };
  if (bytes.size() < 16 || std::memcmp(bytes.data(), kMagic, sizeof(kMagic)) != 0) {
    return damaged(bytes.size() < 16 ? "too short" : "not a checkpoint file (bad magic)");
  }
  const uint32_t stored = GetU32(bytes, bytes.size() - 4);
  const uint32_t computed = Crc32(bytes.data(), bytes.size() - 4);
  if (stored != computed) {
    return damaged(absl::StrFormat("CRC-32 mismatch (stored %08x, computed %08x over %d bytes)",
                                   stored, computed, bytes.size() - 4));
  }
  if (GetU32(bytes, 4) != kFormatVersion) {
    return damaged(
        absl::StrCat("format version ", GetU32(bytes, 4), ", expected ", kFormatVersion));
  }
  const uint32_t header_len = GetU32(bytes, 8);
  v1::CheckpointHeader header;
  if (header_len > kMaxHeaderBytes || 12 + header_len > bytes.size() - 4 ||
      !header.ParseFromArray(bytes.data() + 12, static_cast<int>(header_len))) {
    return damaged("unreadable header");
  }
  ServerCheckpoint c;
  c.job_id = header.job_id();
  c.server_index = header.server_index();
  c.num_servers = header.num_servers();
  c.step = header.step();
  c.generation = header.generation();
  c.total_floats = header.total_floats();
  c.base_step = header.base_step();
  c.base_generation = header.base_generation();
  size_t at = 12 + header_len;
  const size_t end = bytes.size() - 4;
  for (const v1::CheckpointHeader::Chunk& h : header.chunks()) {
    if (h.size() < 0 || h.state_floats() < 0 ||
        static_cast<uint64_t>(h.size() + h.state_floats()) * sizeof(float) > end - at) {
      return damaged(absl::StrCat("chunk ", h.id(), " runs past the end of the file"));
    }
    ChunkCheckpoint& chunk = c.chunks.emplace_back();
    chunk.id = h.id();
    chunk.version = h.version();
    chunk.values = FloatsAt(bytes, at, h.size());
    at += h.size() * sizeof(float);
    chunk.state = FloatsAt(bytes, at, h.state_floats());
    at += h.state_floats() * sizeof(float);
  }
  for (const v1::CheckpointHeader::Table& h : header.tables()) {
    const uint64_t row_bytes = 32 + 4 * (uint64_t{static_cast<uint32_t>(h.dim())} +
                                         static_cast<uint32_t>(h.state_floats()));
    if (h.dim() < 1 || h.state_floats() < 0 || h.rows() < 0 || h.deleted() < 0 ||
        h.filter_counters() < 0 || static_cast<uint64_t>(h.rows()) > (end - at) / row_bytes ||
        static_cast<uint64_t>(h.deleted()) > (end - at - h.rows() * row_bytes) / 8 ||
        static_cast<uint64_t>(h.filter_counters()) >
            (end - at - h.rows() * row_bytes - h.deleted() * 8) / 2) {
      return damaged(absl::StrCat("table ", h.index(), " runs past the end of the file"));
    }
    TableCheckpoint& table = c.tables.emplace_back();
    table.index = h.index();
    table.dim = h.dim();
    table.state_floats = h.state_floats();
    table.version = h.version();
    table.rows.resize(h.rows());
    for (SparseTable::Row& row : table.rows) {
      row.key = GetU64(bytes, at);
      row.last_step = static_cast<int64_t>(GetU64(bytes, at + 8));
      row.touches = static_cast<int64_t>(GetU64(bytes, at + 16));
      row.updates = static_cast<int64_t>(GetU64(bytes, at + 24));
      at += 32;
      row.values = FloatsAt(bytes, at, h.dim());
      at += 4 * static_cast<size_t>(h.dim());
      row.state = FloatsAt(bytes, at, h.state_floats());
      at += 4 * static_cast<size_t>(h.state_floats());
    }
    table.deleted.resize(h.deleted());
    for (uint64_t& key : table.deleted) {
      key = GetU64(bytes, at);
      at += 8;
    }
    if (!h.filter_ages()) {
      if (h.filter_counters() > 0) {
        LOG(WARNING) << "checkpoint " << path << ": table " << h.index()
                     << "'s admission filter is of the kind that did not age: it starts empty";
      }
      at += 2 * h.filter_counters();
      continue;
    }
    if (h.filter_current() > 1 || h.filter_current_sightings() < 0) {
      return damaged(absl::StrCat("table ", h.index(), "'s filter state"));
    }
    table.filter.current = h.filter_current();
    table.filter.current_sightings = h.filter_current_sightings();
    table.filter.counters.resize(h.filter_counters());
    for (uint16_t& counter : table.filter.counters) {
      counter = static_cast<uint16_t>(static_cast<uint8_t>(bytes[at]) |
                                      static_cast<uint8_t>(bytes[at + 1]) << 8);
      at += 2;
    }
  }
  if (at != end) return damaged(absl::StrCat(end - at, " bytes beyond the last chunk or table"));
  return c;
}

absl::StatusOr<ServerCheckpoint> ReadCheckpointChain(FileSystem* fs, const std::string& dir,
                                                     const std::string& job_id, uint32_t server,
                                                     int64_t step, int64_t generation) {
  const std::string path = CheckpointPath(dir, job_id, server, step, generation);
  PSTRAIN_ASSIGN_OR_RETURN(ServerCheckpoint newest, ReadCheckpoint(fs, path));
  // The chain, newest first: each base is older (its header says the step
  // its name does, so the chain ends), of the same job, server and
  // generation, with the same tables.
  std::vector<ServerCheckpoint> chain;
  chain.push_back(std::move(newest));
  while (chain.back().base_step != 0) {
    const ServerCheckpoint& c = chain.back();
    const std::string base_path =
        CheckpointPath(dir, job_id, server, c.base_step, c.base_generation);
    auto broken = [&](absl::string_view why) {
      return absl::DataLossError(
          absl::StrCat("checkpoint ", path, " cannot be restored: its base ", base_path, " ", why));
    };
    if (c.base_step >= c.step || c.base_generation != c.generation) {
      return broken("is not an older checkpoint of its generation");
    }
    absl::StatusOr<ServerCheckpoint> base = ReadCheckpoint(fs, base_path);
    if (!base.ok()) return broken(absl::StrCat("is unreadable: ", base.status().message()));
    if (base->step != c.base_step || base->generation != c.base_generation) {
      return broken(absl::StrCat("holds step ", base->step, " of generation ", base->generation));
    }
    if (base->job_id != c.job_id || base->server_index != c.server_index ||
        base->tables.size() != c.tables.size()) {
      return broken("belongs to another job, server or set of tables");
    }
    for (size_t t = 0; t < c.tables.size(); ++t) {
      if (base->tables[t].dim != c.tables[t].dim ||
          base->tables[t].state_floats != c.tables[t].state_floats) {
        return broken(absl::StrCat("has table ", t, " of another row size"));
      }
    }
    chain.push_back(*std::move(base));
  }
  // From the full checkpoint up, each one's rows merged over the rows
  // before it.
  for (size_t i = chain.size() - 1; i > 0; --i) {
    for (size_t t = 0; t < chain[i].tables.size(); ++t) {
      MergeRows(chain[i].tables[t], chain[i - 1].tables[t]);
    }
  }
  ServerCheckpoint merged = std::move(chain.front());
  merged.base_step = 0;
  merged.base_generation = 0;
  return merged;
}

absl::StatusOr<std::unique_ptr<CheckpointRowReader>> CheckpointRowReader::Open(
    FileSystem* fs, const std::string& path) {
  // The CRC first: of every byte but the last four, which hold it.
  {
    PSTRAIN_ASSIGN_OR_RETURN(std::unique_ptr<ReadableFile> file, fs->OpenForRead(path));
    uint32_t crc = 0;
    std::string tail;  // the last 4 bytes read so far
    while (true) {
      PSTRAIN_ASSIGN_OR_RETURN(std::string piece, file->Read(kFlushBytes));
      if (piece.empty()) break;
      tail += piece;
      if (tail.size() > 4) {
        crc = Crc32(tail.data(), tail.size() - 4, crc);
        tail.erase(0, tail.size() - 4);
      }
    }
    if (tail.size() < 4 || GetU32(tail, 0) != crc) {
      return absl::DataLossError(
          absl::StrCat("checkpoint ", path, " is damaged: CRC-32 mismatch or too short"));
    }
  }
  PSTRAIN_ASSIGN_OR_RETURN(std::unique_ptr<ReadableFile> file, fs->OpenForRead(path));
  PSTRAIN_ASSIGN_OR_RETURN(v1::CheckpointHeader header, ReadHeaderFrom(*file, path));
  std::unique_ptr<CheckpointRowReader> r(new CheckpointRowReader(path, std::move(file)));
  r->header_ = std::move(header);
  for (const v1::CheckpointHeader::Chunk& c : r->header_.chunks()) {
    if (c.size() < 0 || c.state_floats() < 0) return r->Damaged("a chunk of negative size");
    PSTRAIN_RETURN_IF_ERROR(r->Skip(4 * static_cast<uint64_t>(c.size() + c.state_floats())));
  }
  // Rows of at most a few megabytes: a header cannot make a row read
  // allocate more.
  for (const v1::CheckpointHeader::Table& t : r->header_.tables()) {
    if (t.dim() < 1 || t.dim() > (1 << 16) || t.state_floats() < 0 ||
        t.state_floats() > (1 << 18) || t.rows() < 0 || t.deleted() < 0 ||
        t.filter_counters() < 0) {
      return r->Damaged("a table of impossible size");
    }
  }
  return r;
}

absl::Status CheckpointRowReader::Damaged(absl::string_view why) const {
  return absl::DataLossError(absl::StrCat("checkpoint ", path_, " is damaged: ", why));
}

absl::StatusOr<absl::string_view> CheckpointRowReader::Take(size_t n) {
  if (buffer_.size() - at_ < n) {
    buffer_.erase(0, at_);
    at_ = 0;
    while (buffer_.size() < n) {
      PSTRAIN_ASSIGN_OR_RETURN(std::string piece, file_->Read(kFlushBytes));
      if (piece.empty()) return Damaged("it ends too early");
      buffer_ += piece;
    }
  }
  const absl::string_view out(buffer_.data() + at_, n);
  at_ += n;
  return out;
}

absl::Status CheckpointRowReader::Skip(uint64_t n) {
  while (n > 0) {
    const size_t step = static_cast<size_t>(std::min<uint64_t>(n, kFlushBytes));
    PSTRAIN_RETURN_IF_ERROR(Take(step).status());
    n -= step;
  }
  return absl::OkStatus();
}

absl::StatusOr<bool> CheckpointRowReader::NextRow(int t, SparseTable::Row& row) {
  if (t < table_ || t >= header_.tables_size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("table ", t, " of ", path_, " read out of order"));
  }
  while (table_ < t) {
    if (table_ >= 0) {  // the rest of this table: rows, deleted keys, filter
      const v1::CheckpointHeader::Table& h = header_.tables(table_);
      PSTRAIN_RETURN_IF_ERROR(Skip(
          static_cast<uint64_t>(left_) *
              (32 + 4 * static_cast<uint64_t>(h.dim() + h.state_floats())) +
          8 * static_cast<uint64_t>(h.deleted()) + 2 * static_cast<uint64_t>(h.filter_counters())));
    }
    ++table_;
    left_ = header_.tables(table_).rows();
  }
  if (left_ == 0) return false;
  const v1::CheckpointHeader::Table& h = header_.tables(t);
  PSTRAIN_ASSIGN_OR_RETURN(const absl::string_view bytes,
                           Take(32 + 4 * static_cast<size_t>(h.dim() + h.state_floats())));
  row.key = GetU64(bytes, 0);
  row.last_step = static_cast<int64_t>(GetU64(bytes, 8));
  row.touches = static_cast<int64_t>(GetU64(bytes, 16));
  row.updates = static_cast<int64_t>(GetU64(bytes, 24));
  row.values.resize(h.dim());
  std::memcpy(row.values.data(), bytes.data() + 32, 4 * h.dim());
  row.state.resize(h.state_floats());
  if (h.state_floats() > 0) {
    std::memcpy(row.state.data(), bytes.data() + 32 + 4 * h.dim(), 4 * h.state_floats());
  }
  --left_;
  return true;
}

std::vector<v1::CheckpointRecord> ListCheckpoints(FileSystem* fs, const std::string& dir,
                                                  const std::string& job_id, uint32_t server,
                                                  bool remove_partial) {
  const std::string parent = CheckpointDirOf(dir, job_id, server);
  std::vector<v1::CheckpointRecord> found;
  absl::StatusOr<std::vector<std::string>> names = fs->ListDir(parent);
  if (!names.ok()) return found;
  for (const std::string& name : *names) {
    v1::CheckpointRecord record;
    if (ParseName(name, &record)) {
      found.push_back(record);
    } else if (remove_partial && absl::EndsWith(name, kTempSuffix)) {
      LOG(WARNING) << "removing " << parent << "/" << name
                   << ": a partial checkpoint (its write did not finish)";
      fs->Remove(absl::StrCat(parent, "/", name)).IgnoreError();
    }
  }
  std::sort(found.begin(), found.end(), [](const auto& a, const auto& b) {
    return std::make_pair(a.step(), a.generation()) < std::make_pair(b.step(), b.generation());
  });
  return found;
}

void PruneCheckpoints(FileSystem* fs, const std::string& dir, const std::string& job_id,
                      uint32_t server, int keep,
                      const std::vector<v1::CheckpointRecord>& retained) {
  std::set<std::pair<int64_t, int64_t>> kept;
  int64_t newest_retained = -1;
  for (const v1::CheckpointRecord& r : retained) {
    kept.emplace(r.step(), r.generation());
    newest_retained = std::max(newest_retained, r.step());
  }
  const std::vector<v1::CheckpointRecord> found = ListCheckpoints(fs, dir, job_id, server, false);
  const size_t newest = found.size() > static_cast<size_t>(keep) ? found.size() - keep : 0;
  std::vector<bool> keeps(found.size(), false);
  for (size_t i = 0; i < found.size(); ++i) {
    keeps[i] = i >= newest || kept.contains({found[i].step(), found[i].generation()}) ||
               (found[i].step() > newest_retained &&
                found.size() - i <= static_cast<size_t>(keep + kUnrecordedSlack));
  }
  // The bases of the kept, newest first: a base is older than what it is
  // the base of, so one pass down keeps whole chains.
  for (size_t i = found.size(); i-- > 0;) {
    if (!keeps[i]) continue;
    const std::string path =
        CheckpointPath(dir, job_id, server, found[i].step(), found[i].generation());
    absl::StatusOr<v1::CheckpointHeader> header = ReadHeader(fs, path);
    if (!header.ok() || header->base_step() == 0) continue;
    for (size_t j = 0; j < i; ++j) {
      if (found[j].step() == header->base_step() &&
          found[j].generation() == header->base_generation()) {
        keeps[j] = true;
      }
    }
  }
  for (size_t i = 0; i < found.size(); ++i) {
    if (keeps[i]) continue;
    const std::string path =
        CheckpointPath(dir, job_id, server, found[i].step(), found[i].generation());
    if (absl::Status s = fs->Remove(path); !s.ok()) {
      LOG(WARNING) << "cannot delete " << path << ": " << s;
    }
  }
}

CheckpointWriter::CheckpointWriter(FileSystem* fs) : fs_(fs) {
  thread_ = std::thread([this] { Loop(); });
}

CheckpointWriter::~CheckpointWriter() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  thread_.join();
}

void CheckpointWriter::Enqueue(std::string dir, ServerCheckpoint checkpoint, DoneFn done) {
  absl::MutexLock lock(&mu_);
  queue_.push_back(Task{std::move(dir), std::move(checkpoint), std::move(done)});
}

int CheckpointWriter::backlog() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(queue_.size()) + writing_;
}

void CheckpointWriter::Loop() {
  while (true) {
    Task task;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](CheckpointWriter* w)
               ABSL_NO_THREAD_SAFETY_ANALYSIS { return w->stopping_ || !w->queue_.empty(); },
          this));
      if (queue_.empty()) return;  // stopping, nothing left
      task = std::move(queue_.front());
      queue_.pop_front();
      ++writing_;
    }
    const absl::Time start = MonotonicNow();
    absl::StatusOr<int64_t> bytes = WriteCheckpoint(fs_, task.dir, task.checkpoint);
    if (task.done) task.done(bytes, absl::ToDoubleSeconds(MonotonicNow() - start));
    absl::MutexLock lock(&mu_);
    --writing_;
  }
}

}  // namespace pstrain::server
