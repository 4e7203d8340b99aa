// pstrain._client: the client library (pstrain/client.h) for Python. Arrays
// cross without copies: numpy arrays through the buffer protocol, torch
// tensors (which have none) as their data_ptr() and size; pstrain.torch
// builds on it. Every call that waits on the network releases the GIL.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "pstrain/client.h"

namespace py = pybind11;

namespace {

// pstrain._client.Error(code, message): an absl::Status that is not OK.
PyObject* g_error = nullptr;

[[noreturn]] void Raise(const absl::Status& status) {
  PyErr_SetObject(g_error, py::make_tuple(absl::StatusCodeToString(status.code()),
                                          std::string(status.message()))
                               .ptr());
  throw py::error_already_set();
}

void Check(const absl::Status& status) {
  if (!status.ok()) Raise(status);
}

template <typename T>
T Value(absl::StatusOr<T> v) {
  if (!v.ok()) Raise(v.status());
  return *std::move(v);
}

// Runs f() with the GIL released: it waits on the network.
template <typename F>
auto Unlocked(F f) {
  py::gil_scoped_release release;
  return f();
}

// Where a float32 array lives: a contiguous buffer (numpy, memoryview) or
// (address, floats) of a torch tensor.
struct FloatSpan {
  float* data = nullptr;
  int64_t size = 0;
};

FloatSpan SpanOf(const py::buffer& buffer, bool writable) {
  py::buffer_info info = buffer.request(writable);
  if (info.format != py::format_descriptor<float>::format() || info.itemsize != 4) {
    throw py::type_error("pstrain: arrays must be float32, got format '" + info.format + "'");
  }
  int64_t expected = 4;
  for (int d = info.ndim - 1; d >= 0; --d) {
    if (info.shape[d] > 1 && info.strides[d] != expected) {
      throw py::value_error("pstrain: arrays must be contiguous (C order)");
    }
    expected *= info.shape[d];
  }
  return {static_cast<float*>(info.ptr), info.size};
}

pstrain::ConnectOptions Connect(const std::string& coordinator, const std::string& cert_file,
                                const std::string& key_file, const std::string& ca_file,
                                const std::string& token, double timeout_s) {
  pstrain::ConnectOptions c;
  c.coordinator = coordinator;
  c.cert_file = cert_file;
  c.key_file = key_file;
  c.ca_file = ca_file;
  c.token = token;
  c.timeout = absl::Seconds(timeout_s);
  return c;
}

// (name, shape) of a parameter or (name, shape, buffer, dtype) of any tensor.
std::vector<pstrain::TensorSpec> TensorSpecsOf(const py::list& tensors) {
  std::vector<pstrain::TensorSpec> specs;
  for (const py::handle item : tensors) {
    const py::sequence t = py::reinterpret_borrow<py::sequence>(item);
    if (t.size() != 2 && t.size() != 4) {
      throw py::value_error("pstrain: a tensor is (name, shape) or (name, shape, buffer, dtype)");
    }
    pstrain::TensorSpec& spec = specs.emplace_back();
    spec.name = t[0].cast<std::string>();
    spec.shape = t[1].cast<std::vector<int64_t>>();
    if (t.size() == 4) {
      spec.buffer = t[2].cast<bool>();
      spec.dtype = t[3].cast<std::string>();
    }
  }
  return specs;
}

// A model's tensors as Python sees them: (name, shape, buffer, dtype,
// float32 values) each.
py::list TensorTuples(const std::vector<pstrain::ModelTensor>& tensors) {
  py::list out;
  for (const pstrain::ModelTensor& t : tensors) {
    out.append(py::make_tuple(
        t.spec.name, t.spec.shape, t.spec.buffer, t.spec.dtype,
        py::array_t<float>(static_cast<py::ssize_t>(t.values.size()), t.values.data())));
  }
  return out;
}

}  // namespace

PYBIND11_MODULE(_client, m) {
  m.doc() = "pstrain's client library: train a model of your own against pstrain's servers";
  g_error = PyErr_NewException("pstrain._client.Error", PyExc_RuntimeError, nullptr);
  m.attr("Error") = py::reinterpret_borrow<py::object>(g_error);

  m.def(
      "submit_job",
      [](const std::string& coordinator, const std::string& job_yaml, const py::list& tensors,
         const std::string& request_id, const std::string& cert_file, const std::string& key_file,
         const std::string& ca_file, const std::string& token, double timeout_s,
         const std::vector<std::tuple<std::string, int, int64_t>>& tables) {
        const std::vector<pstrain::TensorSpec> specs = TensorSpecsOf(tensors);
        std::vector<pstrain::TableDeclaration> declared;
        for (const auto& [name, dim, initial_rows] : tables) {
          declared.push_back({.name = name, .dim = dim, .initial_rows = initial_rows});
        }
        return Value(Unlocked([&] {
          return pstrain::SubmitJob(
              Connect(coordinator, cert_file, key_file, ca_file, token, timeout_s), job_yaml,
              specs, request_id, declared);
        }));
      },
      py::arg("coordinator"), py::arg("job_yaml"), py::arg("tensors"),
      py::arg("request_id") = "", py::arg("cert_file") = "", py::arg("key_file") = "",
      py::arg("ca_file") = "", py::arg("token") = "", py::arg("timeout_s") = 30.0,
      py::arg("tables") = std::vector<std::tuple<std::string, int, int64_t>>(),
      "Submits a job whose model is external, of `tensors`: (name, shape) of a parameter, "
      "(name, shape, True, dtype) of a buffer; `tables`: (name, dim, initial_rows) of each "
      "table the model brings (TableDeclaration); returns its id.");

  m.def(
      "sample_order",
      [](uint64_t seed, int64_t epoch, int64_t n) {
        if (n < 0 || epoch < 0) throw py::value_error("pstrain: negative epoch or size");
        std::vector<int64_t> v = pstrain::SampleOrder(seed, epoch, n);
        return py::array_t<int64_t>(static_cast<py::ssize_t>(v.size()), v.data());
      },
      py::arg("seed"), py::arg("epoch"), py::arg("n"),
      "The order pstrain's sharding takes an epoch of n samples in (batch_indices cuts it).");
  m.def(
      "read_model",
      [](const std::string& path) { return TensorTuples(Value(pstrain::ReadModel(path))); },
      py::arg("path"),
      "The tensors of a model file: (name, shape, buffer, dtype, float32 values) each, a "
      "buffer's bytes first in its values.");
  m.def(
      "read_export",
      [](const std::string& path) {
        pstrain::ModelExport exported = Value(pstrain::ReadExport(path));
        py::list tables;
        for (const pstrain::ExportedTable& t : exported.tables) {
          const auto rows = static_cast<py::ssize_t>(t.keys.size());
          tables.append(py::make_tuple(
              t.name, t.dim, py::array_t<uint64_t>(rows, t.keys.data()),
              py::array_t<float>({rows, static_cast<py::ssize_t>(t.dim)}, t.rows.data())));
        }
        return py::make_tuple(TensorTuples(exported.tensors), tables);
      },
      py::arg("path"),
      "A model file, or an export directory of a job with tables: (tensors, tables), the "
      "tensors as read_model gives them, the tables (name, dim, uint64 keys ascending, "
      "float32 rows [keys, dim]) in the job's order (none for a model file).");
  m.def(
      "set_log_level", [](const std::string& level) { Check(pstrain::SetLogLevel(level)); },
      py::arg("level"),
      "The library's log lines on stderr from this level up: info, warning, error or off.");
  m.def("copied_payload_bytes", &pstrain::DataPlaneCopiedBytes,
        "Payload bytes the data plane has copied in this process (0: every push and pull "
        "went from and to the arrays' own memory).");

  py::class_<pstrain::ClickReader>(m, "ClickReader")
      .def(py::init([](const std::vector<std::string>& files, int dense, int fields,
                       uint64_t seed, int64_t epoch, int64_t shuffle_window) {
             return Value(pstrain::ClickReader::Open({.files = files,
                                                      .dense = dense,
                                                      .fields = fields,
                                                      .seed = seed,
                                                      .epoch = epoch,
                                                      .shuffle_window = shuffle_window}));
           }),
           py::arg("files"), py::arg("dense") = 13, py::arg("fields") = 26, py::arg("seed") = 0,
           py::arg("epoch") = 0, py::arg("shuffle_window") = 65536,
           "Click logs in Criteo's layout, in the order a click job's workers read them "
           "(docs/click-data.md).")
      .def(
          "read",
          [](pstrain::ClickReader& r, int64_t from, int64_t count) {
            pstrain::ClickSamples s = Value(Unlocked([&] { return r.Read(from, count); }));
            const auto n = static_cast<py::ssize_t>(s.labels.size());
            const py::ssize_t dense = n == 0 ? 0 : static_cast<py::ssize_t>(s.dense.size()) / n;
            return py::make_tuple(
                py::array_t<float>(n, s.labels.data()),
                py::array_t<float>(std::vector<py::ssize_t>{n, dense}, s.dense.data()),
                py::array_t<int64_t>(static_cast<py::ssize_t>(s.bag_starts.size()),
                                     s.bag_starts.data()),
                py::array_t<uint64_t>(static_cast<py::ssize_t>(s.keys.size()), s.keys.data()));
          },
          py::arg("start"), py::arg("count"),
          "Positions [start, start + count): (labels float32[n], dense float32[n, dense], "
          "bag_starts int64[n * fields + 1], keys uint64[]); bag b = sample * fields + field "
          "holds keys[bag_starts[b]:bag_starts[b + 1]].")
      .def(
          "available",
          [](pstrain::ClickReader& r, int64_t end) {
            return Value(Unlocked([&] { return r.Available(end); }));
          },
          py::arg("end"), "How many of positions [0, end) the epoch has.");

  py::class_<pstrain::Client>(m, "Client")
      .def(py::init([](const std::string& coordinator, const std::string& job_id,
                       const std::string& node_id, const std::string& cert_file,
                       const std::string& key_file, const std::string& ca_file,
                       double join_timeout_s, double timeout_s) {
             pstrain::Client::Options o;
             o.connect = Connect(coordinator, cert_file, key_file, ca_file, "", timeout_s);
             o.job_id = job_id;
             o.node_id = node_id;
             o.join_timeout = absl::Seconds(join_timeout_s);
             return Value(Unlocked([&] { return pstrain::Client::Join(std::move(o)); }));
           }),
           py::arg("coordinator"), py::arg("job_id"), py::arg("node_id") = "",
           py::arg("cert_file") = "", py::arg("key_file") = "", py::arg("ca_file") = "",
           py::arg("join_timeout_s") = 600.0, py::arg("timeout_s") = 30.0,
           "Joins the job as one of its workers; returns once the coordinator placed it.")
      .def_property_readonly("job_id", &pstrain::Client::job_id)
      .def_property_readonly("node_id", &pstrain::Client::node_id)
      .def_property_readonly("worker_index", &pstrain::Client::worker_index)
      .def_property_readonly("num_workers", &pstrain::Client::num_workers)
      .def_property_readonly("batch_size", &pstrain::Client::batch_size)
      .def_property_readonly("batch_offset", &pstrain::Client::batch_offset)
      .def_property_readonly("global_batch", &pstrain::Client::global_batch)
      .def_property_readonly("total_steps", &pstrain::Client::total_steps)
      .def_property_readonly("steps_per_epoch", &pstrain::Client::steps_per_epoch)
      .def_property_readonly("seed", &pstrain::Client::seed)
      .def_property_readonly("mode", &pstrain::Client::mode)
      .def_property_readonly("gradient_scale", &pstrain::Client::gradient_scale)
      .def_property_readonly("accumulate_steps", &pstrain::Client::accumulate_steps)
      .def_property_readonly("loss_scale", &pstrain::Client::loss_scale)
      .def_property_readonly("step", &pstrain::Client::step)
      .def_property_readonly("generation", &pstrain::Client::generation)
      .def_property_readonly("tensors",
                             [](const pstrain::Client& c) {
                               std::vector<std::pair<std::string, std::vector<int64_t>>> out;
                               for (const pstrain::TensorSpec& t : c.tensors()) {
                                 out.emplace_back(t.name, t.shape);
                               }
                               return out;
                             })
      .def_property_readonly("tables",
                             [](const pstrain::Client& c) {
                               std::vector<std::pair<std::string, int>> out;
                               for (const pstrain::TableInfo& t : c.tables()) {
                                 out.emplace_back(t.name, t.dim);
                               }
                               return out;
                             },
                             "(name, dim) of each of the job's embedding tables.")
      .def_property_readonly(
          "initial_rows",
          [](const pstrain::Client& c) {
            std::vector<int64_t> out;
            for (const pstrain::TableInfo& t : c.tables()) out.push_back(t.initial_rows);
            return out;
          },
          "Each table's initial_rows (0: none), in the tables' order.")
      .def("table_index",
           [](const pstrain::Client& c, const std::string& name) {
             return Value(c.TableIndex(name));
           })
      .def(
          "pull_rows",
          [](pstrain::Client& c, const std::vector<std::tuple<int, uintptr_t, int64_t, uintptr_t>>&
                                     pulls) {
            std::vector<pstrain::RowPull> rows;
            for (const auto& [table, keys, n, values] : pulls) {
              rows.push_back({table, reinterpret_cast<const uint64_t*>(keys), n,
                              reinterpret_cast<float*>(values)});
            }
            Check(Unlocked([&] { return c.PullRows(rows); }));
          },
          py::arg("pulls"),
          "Pulls rows: (table, keys address, n, rows address) each, n distinct 64-bit keys "
          "and n * dim float32 for their rows; one exchange per server for all.")
      .def(
          "push_rows_address",
          [](pstrain::Client& c, int table, uintptr_t keys, uintptr_t counts, uintptr_t grads,
             int64_t n) {
            Check(c.PushRowGradients(table, reinterpret_cast<const uint64_t*>(keys),
                                     reinterpret_cast<const uint32_t*>(counts),
                                     reinterpret_cast<const float*>(grads), n));
          },
          py::arg("table"), py::arg("keys"), py::arg("counts"), py::arg("grads"), py::arg("n"),
          "The step's gradients of a table's rows: n distinct keys (uint64), their counts in "
          "the batch (uint32) and gradients (n * dim float32), by address; copied at once.")
      .def_property_readonly(
          "buffers",
          [](const pstrain::Client& c) {
            std::vector<std::pair<int, std::string>> out;
            for (size_t t = 0; t < c.tensors().size(); ++t) {
              if (c.tensors()[t].buffer) out.emplace_back(t, c.tensors()[t].dtype);
            }
            return out;
          },
          "(index, dtype) of each buffer among the tensors.")
      .def("tensor_index",
           [](const pstrain::Client& c, const std::string& name) {
             return Value(c.TensorIndex(name));
           })
      .def(
          "bind",
          [](pstrain::Client& c, int tensor, py::buffer values) {
            const FloatSpan s = SpanOf(values, /*writable=*/true);
            Check(c.BindTensor(tensor, s.data, s.size));
          },
          py::arg("tensor"), py::arg("values"),
          "The tensor's values live in `values` (float32, contiguous, writable): the new "
          "values are written there in place. Keep it alive.")
      .def(
          "bind_address",
          [](pstrain::Client& c, int tensor, uintptr_t address, int64_t size) {
            Check(c.BindTensor(tensor, reinterpret_cast<float*>(address), size));
          },
          py::arg("tensor"), py::arg("address"), py::arg("size"),
          "bind for memory given by address (a torch tensor's data_ptr()) and float count.")
      .def(
          "bind_table_rows",
          [](pstrain::Client& c, int table, uintptr_t address, int64_t rows) {
            Check(c.BindTableRows(table, reinterpret_cast<const float*>(address), rows));
          },
          py::arg("table"), py::arg("address"), py::arg("rows"),
          "A table's initial rows (its initial_rows): `rows` rows of dim floats at address (a "
          "contiguous float32 tensor's data_ptr()), row k key k's; they must stay alive and "
          "unchanged while the client lives.")
      .def("start", [](pstrain::Client& c) { Check(Unlocked([&] { return c.Start(); })); })
      .def(
          "batch_indices",
          [](const pstrain::Client& c, int64_t step, int64_t dataset_size) {
            std::vector<int64_t> v = Value(c.BatchIndices(step, dataset_size));
            return py::array_t<int64_t>(static_cast<py::ssize_t>(v.size()), v.data());
          },
          py::arg("step"), py::arg("dataset_size"))
      .def(
          "push",
          [](pstrain::Client& c, int tensor, py::buffer grad) {
            const FloatSpan s = SpanOf(grad, /*writable=*/false);
            Check(c.PushGradient(tensor, s.data, s.size));
          },
          py::arg("tensor"), py::arg("grad"),
          "Starts pushing the gradient from its own memory; it must stay alive and unchanged "
          "until end_step returns.")
      .def(
          "push_address",
          [](pstrain::Client& c, int tensor, uintptr_t address, int64_t size) {
            Check(c.PushGradient(tensor, reinterpret_cast<const float*>(address), size));
          },
          py::arg("tensor"), py::arg("address"), py::arg("size"))
      .def(
          "end_step",
          [](pstrain::Client& c, double loss, int64_t samples, bool await_values) {
            return Value(Unlocked([&] { return c.EndStep(loss, samples, await_values); }));
          },
          py::arg("loss"), py::arg("samples"), py::arg("await_values") = true,
          "Ends the step; waits for the new values (in the bound memory), or with "
          "await_values=False leaves them to await_values(tensor); returns the step to "
          "compute next.")
      .def(
          "await_values",
          [](pstrain::Client& c, const std::vector<int>& tensors) {
            Check(Unlocked([&] {
              absl::Status status;
              for (size_t i = 0; i < tensors.size() && status.ok(); ++i) {
                status = c.AwaitValues(tensors[i]);
              }
              return status;
            }));
          },
          py::arg("tensors"),
          "Waits until these tensors' values of the step end_step(await_values=False) ended "
          "are in their bound memory.")
      .def("pull",
           [](pstrain::Client& c) { Check(Unlocked([&] { return c.Pull(); })); })
      .def(
          "finish",
          [](pstrain::Client& c, std::optional<double> accuracy, std::optional<double> loss,
             const std::map<std::string, double>& metrics) {
            Check(c.ReportMetrics(metrics));
            std::optional<pstrain::Evaluation> eval;
            if (accuracy.has_value()) eval = pstrain::Evaluation{*accuracy, loss};
            // A loss without an accuracy is one of the script's metrics.
            if (!accuracy.has_value() && loss.has_value()) {
              Check(c.ReportMetrics({{"test_loss", *loss}}));
            }
            Check(Unlocked([&] { return c.Finish(eval); }));
          },
          py::arg("test_accuracy") = py::none(), py::arg("test_loss") = py::none(),
          py::arg("metrics") = std::map<std::string, double>(),
          "Ends this worker's part, with the script's final metrics ({name: value}); worker "
          "0 reports the test accuracy and loss of the final model.")
      .def(
          "report_metrics",
          [](pstrain::Client& c, const std::map<std::string, double>& metrics) {
            Check(c.ReportMetrics(metrics));
          },
          py::arg("metrics"),
          "The script's own metrics ({name: value}): the latest of each goes with the "
          "progress reports and the final one; the job shows their mean over the workers.")
      .def(
          "fail",
          [](pstrain::Client& c, const std::string& message) {
            Check(Unlocked([&] { return c.Fail(message); }));
          },
          py::arg("message"));
}
