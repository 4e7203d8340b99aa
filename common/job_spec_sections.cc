#include <algorithm>
#include <set>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "common/click_generator.h"
#include "common/enum_names.h"
#include "common/job_spec.h"
#include "common/job_spec_sections.h"
#include "common/job_yaml.h"

namespace pstrain::job_spec_sections {

// Fills in an embedding table's defaults and checks its fields.
absl::Status NormalizeTable(const std::string& at, v1::EmbeddingTableSpec& t) {
  const bool named = !t.name().empty() && t.name().size() <= 64 &&
                     std::all_of(t.name().begin(), t.name().end(), [](char c) {
                       return absl::ascii_isalnum(c) || c == '_' || c == '.' || c == '-';
                     });
  if (!named) return FieldError(at + ".name", "1 to 64 of A-Z, a-z, 0-9, _, . and -");
  if (t.dim() < 1 || t.dim() > 1024) {
    return FieldError(at + ".dim", absl::StrCat("must be in [1, 1024], got ", t.dim()));
  }
  v1::TableInitializer& init = *t.mutable_initializer();
  if (!v1::TableInitializerType_IsValid(init.type())) {
    return FieldError(at + ".initializer.type", absl::StrCat("unknown value ", init.type()));
  }
  if (init.type() == v1::TABLE_INITIALIZER_TYPE_UNSPECIFIED) {
    init.set_type(v1::TABLE_INITIALIZER_TYPE_UNIFORM);
  }
  if (init.type() == v1::TABLE_INITIALIZER_TYPE_ZEROS && init.has_scale()) {
    return FieldError(at + ".initializer.scale", "zeros have no scale");
  }
  if (init.type() != v1::TABLE_INITIALIZER_TYPE_ZEROS && !init.has_scale()) init.set_scale(0.01f);
  if (!(init.scale() >= 0 && init.scale() <= 10)) {
    return FieldError(at + ".initializer.scale", "must be in [0, 10]");
  }
  v1::TableOptimizer& opt = *t.mutable_optimizer();
  const std::string o = at + ".optimizer";
  if (!v1::TableOptimizerType_IsValid(opt.type())) {
    return FieldError(o + ".type", absl::StrCat("unknown value ", opt.type()));
  }
  if (opt.type() == v1::TABLE_OPTIMIZER_TYPE_UNSPECIFIED) {
    opt.set_type(v1::TABLE_OPTIMIZER_TYPE_ADAGRAD);
  }
  if (opt.learning_rate() == 0) opt.set_learning_rate(0.01f);
  if (!(opt.learning_rate() > 0 && opt.learning_rate() <= 1000)) {
    return FieldError(o + ".learning_rate", "must be in (0, 1000]");
  }
  const v1::TableOptimizerType type = opt.type();
  const bool adagrad = type == v1::TABLE_OPTIMIZER_TYPE_ADAGRAD ||
                       type == v1::TABLE_OPTIMIZER_TYPE_ROWWISE_ADAGRAD;
  const bool adam = type == v1::TABLE_OPTIMIZER_TYPE_ADAM;
  const bool ftrl = type == v1::TABLE_OPTIMIZER_TYPE_FTRL;
  struct Applies {
    bool set;
    const char* field;
    bool applies;
    const char* types;
  };
  const Applies fields[] = {
      {opt.has_initial_accumulator(), "initial_accumulator", adagrad || ftrl,
       "adagrad, rowwise_adagrad and ftrl"},
      {opt.has_beta1(), "beta1", adam, "adam"},
      {opt.has_beta2(), "beta2", adam, "adam"},
      {opt.has_epsilon(), "epsilon", adagrad || adam, "adagrad, rowwise_adagrad and adam"},
      {opt.l1() != 0, "l1", ftrl, "ftrl"},
      {opt.l2() != 0, "l2", ftrl, "ftrl"},
      {opt.has_beta(), "beta", ftrl, "ftrl"},
  };
  for (const Applies& f : fields) {
    if (f.set && !f.applies) {
      return FieldError(absl::StrCat(o, ".", f.field),
                        absl::StrCat("applies to ", f.types, " only"));
    }
  }
  if ((adagrad || ftrl) && !opt.has_initial_accumulator()) opt.set_initial_accumulator(0.1f);
  if (adam && !opt.has_beta1()) opt.set_beta1(0.9f);
  if (adam && !opt.has_beta2()) opt.set_beta2(0.999f);
  if ((adagrad || adam) && !opt.has_epsilon()) opt.set_epsilon(1e-8f);
  if (ftrl && !opt.has_beta()) opt.set_beta(1.0f);
  if (!(opt.initial_accumulator() >= 0 && opt.initial_accumulator() <= 1e6)) {
    return FieldError(o + ".initial_accumulator", "must be in [0, 1e6]");
  }
  if (!(opt.beta1() >= 0 && opt.beta1() < 1) || !(opt.beta2() >= 0 && opt.beta2() < 1)) {
    return FieldError(o + (opt.beta1() >= 0 && opt.beta1() < 1 ? ".beta2" : ".beta1"),
                      "must be in [0, 1)");
  }
  if (adagrad || adam) {
    if (!(opt.epsilon() > 0 && opt.epsilon() <= 1)) {
      return FieldError(o + ".epsilon", "must be in (0, 1]");
    }
  }
  if (!(opt.l1() >= 0 && opt.l1() <= 1e6) || !(opt.l2() >= 0 && opt.l2() <= 1e6) ||
      !(opt.beta() >= 0 && opt.beta() <= 1e6)) {
    return FieldError(o, "l1, l2 and beta must be in [0, 1e6]");
  }
  v1::TableAdmission& admission = *t.mutable_admission();
  const std::string a = at + ".admission";
  if (admission.min_count() == 0) admission.set_min_count(1);
  if (admission.min_count() < 1 || admission.min_count() > 65535) {
    return FieldError(a + ".min_count", "must be in [0, 65535]");
  }
  if (!admission.has_probability()) admission.set_probability(1.0);
  if (!(admission.probability() > 0 && admission.probability() <= 1)) {
    return FieldError(a + ".probability", "must be in (0, 1]");
  }
  const bool filtered = admission.min_count() > 1 || admission.probability() < 1;
  if (admission.filter_counters() != 0 && !filtered) {
    return FieldError(a + ".filter_counters", "only with min_count > 1 or probability < 1");
  }
  if (filtered && admission.filter_counters() == 0) admission.set_filter_counters(1 << 20);
  if (admission.filter_counters() < 0 || admission.filter_counters() == 1 ||
      admission.filter_counters() > (int64_t{1} << 32)) {
    return FieldError(a + ".filter_counters", "must be in [2, 2^32]");
  }
  if (admission.has_max_false_admission() && !filtered) {
    return FieldError(a + ".max_false_admission", "only with min_count > 1 or probability < 1");
  }
  if (filtered && !admission.has_max_false_admission()) admission.set_max_false_admission(0.01);
  if (admission.has_max_false_admission() &&
      !(admission.max_false_admission() > 0 && admission.max_false_admission() <= 0.5)) {
    return FieldError(a + ".max_false_admission", "must be in (0, 0.5]");
  }
  v1::TableEviction& eviction = *t.mutable_eviction();
  if (eviction.ttl_steps() < 0 || eviction.ttl_steps() > (int64_t{1} << 40)) {
    return FieldError(at + ".eviction.ttl_steps", "must be in [0, 2^40]");
  }
  if (!v1::TableEvictionPolicy_IsValid(eviction.policy())) {
    return FieldError(at + ".eviction.policy", absl::StrCat("unknown value ", eviction.policy()));
  }
  if (eviction.policy() == v1::TABLE_EVICTION_POLICY_UNSPECIFIED) {
    eviction.set_policy(v1::TABLE_EVICTION_POLICY_LRU);
  }
  if (t.max_memory_bytes() < 0) return FieldError(at + ".max_memory_bytes", "must be >= 0");
  if (t.initial_rows() < 0 || t.initial_rows() * t.dim() > kMaxParams) {
    return FieldError(at + ".initial_rows",
                      absl::StrCat("must be in [0, ", kMaxParams / t.dim(), "] (", kMaxParams,
                                   " values at most)"));
  }
  if (t.initial_rows() > 0 && (eviction.ttl_steps() > 0 || t.max_memory_bytes() > 0)) {
    return FieldError(at + ".initial_rows",
                      "a table that starts from given rows keeps them: no ttl_steps or "
                      "max_memory_bytes");
  }
  if (t.value_dtype() == v1::DTYPE_UNSPECIFIED) t.set_value_dtype(v1::DTYPE_FP32);
  if (t.value_dtype() != v1::DTYPE_FP32 && t.value_dtype() != v1::DTYPE_BF16) {
    return FieldError(at + ".value_dtype", "must be fp32 or bf16");
  }
  return absl::OkStatus();
}

// The click model's MLPs, interaction and pooling.
absl::Status NormalizeClickModel(v1::ClickModelSpec& click) {
  for (auto [name, widths] : {std::pair{"bottom", click.mutable_bottom()},
                              std::pair{"top", click.mutable_top()}}) {
    if (widths->empty()) widths->Add(64);
    if (widths->size() > 16) return FieldError(absl::StrCat("model.click.", name), "at most 16 layers");
    for (int i = 0; i < widths->size(); ++i) {
      if (widths->Get(i) < 1 || widths->Get(i) > 16384) {
        return FieldError(absl::StrCat("model.click.", name, "[", i, "]"),
                          absl::StrCat("must be in [1, 16384], got ", widths->Get(i)));
      }
    }
  }
  if (!v1::Interaction_IsValid(click.interaction()) || !v1::Pooling_IsValid(click.pooling())) {
    return FieldError(v1::Interaction_IsValid(click.interaction()) ? "model.click.pooling"
                                                                   : "model.click.interaction",
                      "unknown value");
  }
  if (click.interaction() == v1::INTERACTION_UNSPECIFIED) click.set_interaction(v1::INTERACTION_DOT);
  if (click.pooling() == v1::POOLING_UNSPECIFIED) click.set_pooling(v1::POOLING_SUM);
  return absl::OkStatus();
}

// data.clicks: files or a generator, the layout and the shuffle window.
absl::Status NormalizeClickData(v1::ClickDataSpec& clicks) {
  const bool generated = clicks.has_generate();
  if (generated == (clicks.train_files_size() > 0)) {
    return FieldError("data.clicks", "give train_files (and test_files) or generate, not both");
  }
  if (clicks.dense() == 0) clicks.set_dense(13);
  if (clicks.fields() == 0) clicks.set_fields(26);
  if (clicks.dense() < 1 || clicks.dense() > 1000) {
    return FieldError("data.clicks.dense", "must be in [1, 1000]");
  }
  if (clicks.fields() < 1 || clicks.fields() > 1000) {
    return FieldError("data.clicks.fields", "must be in [1, 1000]");
  }
  if (!clicks.has_shuffle_window()) clicks.set_shuffle_window(65536);
  if (clicks.shuffle_window() < 0 || clicks.shuffle_window() > (int64_t{1} << 24)) {
    return FieldError("data.clicks.shuffle_window", "must be in [0, 2^24]");
  }
  if (clicks.test_samples() < 0) return FieldError("data.clicks.test_samples", "must be >= 0");
  if (generated) {
    if (clicks.test_files_size() > 0) {
      return FieldError("data.clicks.test_files", "generated data has its own test split");
    }
    if (clicks.shuffle_window() > 1) clicks.set_shuffle_window(0);  // rows are drawn independently
    v1::ClickGeneratorSpec& g = *clicks.mutable_generate();
    const ClickDataSpec defaults;
    if (g.vocabulary() == 0) g.set_vocabulary(defaults.vocabulary);
    if (!g.has_zipf()) g.set_zipf(defaults.zipf);
    if (g.max_values() == 0) g.set_max_values(defaults.max_values);
    if (!g.has_token_weight()) g.set_token_weight(defaults.token_weight);
    if (!g.has_dense_weight()) g.set_dense_weight(defaults.dense_weight);
    if (!g.has_bias()) g.set_bias(defaults.bias);
    v1::DataSpec data;
    *data.mutable_clicks() = clicks;
    if (absl::Status s = CheckClickDataSpec(ClickDataSpecOf(data)); !s.ok()) {
      return FieldError("data.clicks.generate", s.message());
    }
    return absl::OkStatus();
  }
  for (const auto* files : {&clicks.train_files(), &clicks.test_files()}) {
    for (const std::string& file : *files) {
      const char* which = files == &clicks.train_files() ? "train_files" : "test_files";
      if (file.empty() || file.front() != '/' || file.size() > kMaxPathBytes) {
        return FieldError(absl::StrCat("data.clicks.", which),
                          absl::StrCat("\"", file.substr(0, 100),
                                       "\" is not an absolute path of at most ", kMaxPathBytes,
                                       " bytes"));
      }
    }
  }
  if (clicks.test_files_size() == 0) {
    return FieldError("data.clicks.test_files", "required: the model is evaluated on them");
  }
  if (clicks.train_files_size() + clicks.test_files_size() > 10000) {
    return FieldError("data.clicks", "at most 10000 files");
  }
  return absl::OkStatus();
}

// A click model's tables: one dimension, and every field read from one.
absl::Status CheckClickTables(const v1::JobSpec& spec) {
  const int fields = spec.data().clicks().fields();
  if (spec.tables_size() == 0) {
    return FieldError("tables", "a click model reads its categorical fields from tables");
  }
  std::vector<int> table_of(fields + 1, -1);
  for (int t = 0; t < spec.tables_size(); ++t) {
    const v1::EmbeddingTableSpec& table = spec.tables(t);
    if (table.dim() != spec.tables(0).dim()) {
      return FieldError(absl::StrCat("tables[", t, "].dim"),
                        absl::StrCat(table.dim(), " differs from tables[0].dim ",
                                     spec.tables(0).dim(), ": the click model's interaction "
                                     "needs one dimension"));
    }
    if (table.fields_size() == 0) {
      return FieldError(absl::StrCat("tables[", t, "].fields"), "required: the fields it serves");
    }
    for (int i = 0; i < table.fields_size(); ++i) {
      const int f = table.fields(i);
      const std::string at = absl::StrCat("tables[", t, "].fields[", i, "]");
      if (f < 1 || f > fields) {
        return FieldError(at, absl::StrCat(f, " is not a field in [1, ", fields, "]"));
      }
      if (table_of[f] >= 0) {
        return FieldError(at, absl::StrCat("field ", f, " is read from tables[", table_of[f],
                                           "] already"));
      }
      table_of[f] = t;
    }
  }
  for (int f = 1; f <= fields; ++f) {
    if (table_of[f] < 0) {
      return FieldError("tables", absl::StrCat("no table reads field ", f, " (of ", fields, ")"));
    }
  }
  return absl::OkStatus();
}

}  // namespace pstrain::job_spec_sections
