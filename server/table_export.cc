#include "server/table_export.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/clock.h"
#include "common/json.h"
#include "common/status.h"
#include "server/checkpoint.h"

namespace pstrain::server {

absl::Status ExportTables(FileSystem* fs, const TableExportSource& source,
                          const std::string& model_file, const std::string& dir,
                          absl::Duration wait) {
  const v1::JobSpec& spec = source.spec;
  const std::string& checkpoints = spec.checkpoint().dir();
  if (spec.tables_size() == 0 || checkpoints.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("job ", source.job_id,
                     spec.tables_size() == 0 ? " has no embedding tables"
                                             : " has no checkpoint.dir to export from"));
  }
  // Every server's checkpoint of the last step (full: the last step's
  // always is), read row by row: tables may be larger than this machine's
  // memory.
  const absl::Time give_up = MonotonicNow() + wait;
  std::vector<std::unique_ptr<CheckpointRowReader>> servers;
  for (uint32_t s = 0; s < static_cast<uint32_t>(spec.num_servers()); ++s) {
    const std::string path =
        CheckpointPath(checkpoints, source.job_id, s, source.step, source.generation);
    while (!fs->Exists(path)) {
      if (MonotonicNow() > give_up) {
        return absl::DeadlineExceededError(
            absl::StrCat("server ", s, "'s checkpoint of the last step, ", path,
                         ", is not there (is the checkpoint directory reachable from here?)"));
      }
      absl::SleepFor(absl::Milliseconds(100));
    }
    PSTRAIN_ASSIGN_OR_RETURN(std::unique_ptr<CheckpointRowReader> reader,
                             CheckpointRowReader::Open(fs, path));
    const v1::CheckpointHeader& h = reader->header();
    if (h.base_step() != 0 || h.tables_size() != spec.tables_size()) {
      return absl::DataLossError(absl::StrCat(path, " is not a full checkpoint of the job's ",
                                              spec.tables_size(), " tables"));
    }
    servers.push_back(std::move(reader));
  }

  PSTRAIN_RETURN_IF_ERROR(fs->MakeDirs(dir + "/tables"));
  if (!model_file.empty()) {
    PSTRAIN_RETURN_IF_ERROR(
        fs->WriteFileAtomically(absl::StrCat(dir, "/", kExportModelFile), model_file));
  }
  std::string manifest = absl::StrCat(
      "{\"job_id\":", JsonQuote(source.job_id), ",\"step\":", source.step,
      ",\"generation\":", source.generation,
      ",\"model\":", model_file.empty() ? "null" : JsonQuote(kExportModelFile), ",\"tables\":[");
  for (int t = 0; t < spec.tables_size(); ++t) {
    const std::string& name = spec.tables(t).name();
    const int dim = spec.tables(t).dim();
    // Each server's rows are by key and no key is on two servers: merged
    // by key, they are the table's.
    int64_t rows = 0;
    for (const auto& server : servers) rows += server->header().tables(t).rows();
    PSTRAIN_ASSIGN_OR_RETURN(std::unique_ptr<TableFileWriter> out,
                             TableFileWriter::Create(fs, ExportTablePath(dir, name), dim, rows));
    std::vector<SparseTable::Row> next(servers.size());
    std::vector<bool> more(servers.size());
    for (size_t s = 0; s < servers.size(); ++s) {
      PSTRAIN_ASSIGN_OR_RETURN(more[s], servers[s]->NextRow(t, next[s]));
    }
    while (true) {
      int least = -1;
      for (size_t s = 0; s < servers.size(); ++s) {
        if (more[s] && (least < 0 || next[s].key < next[least].key)) least = static_cast<int>(s);
      }
      if (least < 0) break;
      PSTRAIN_RETURN_IF_ERROR(out->Append(next[least].key, next[least].values));
      PSTRAIN_ASSIGN_OR_RETURN(more[least], servers[least]->NextRow(t, next[least]));
    }
    PSTRAIN_RETURN_IF_ERROR(out->Finish());
    absl::StrAppend(&manifest, t > 0 ? "," : "", "{\"name\":", JsonQuote(name), ",\"dim\":", dim,
                    ",\"rows\":", rows, ",\"file\":", JsonQuote("tables/" + name + ".rows"), "}");
  }
  absl::StrAppend(&manifest, "]}\n");
  return fs->WriteFileAtomically(absl::StrCat(dir, "/", kExportManifest), manifest);
}

}  // namespace pstrain::server
