// shard-bench-gpu: the GPU data path's kernels against the device's own limits, measured in the
// same run.
//   * The fused Adam step in GB/s against a device-to-device copy. An fp32 Adam update reads
//     param, grad, exp_avg, exp_avg_sq and writes param, exp_avg, exp_avg_sq: 7 x 4 bytes per
//     element (+2 with a bf16 model copy); the copy moves 2 bytes (read + write) per byte
//     copied. Target: >= 0.85x the copy.
//   * MLP training steps (forward, backward, fused Adam) per second at each precision.
//   * Shard's NCCL communicator at world size 1: each collective's device time from the compute
//     stream's point of view (ordered after it, then the compute stream ordered after it), at
//     a small size (what one call costs) and large ones against the copy. One GPU cannot show
//     NCCL's bandwidth between GPUs: at world size 1 an out-of-place collective is a copy.
// Timed with CUDA events around each repetition after warm-up; medians. GB/s count the bytes
// read and written, as the copy's.
#include <algorithm>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "absl/strings/str_format.h"
#include "bench/harness.h"
#include "common/cli.h"
#include "common/mlp.h"
#include "worker/gpu/cuda_check.h"
#include "worker/gpu/cuda_resources.h"
#include "worker/gpu/gpu_mlp.h"
#include "worker/gpu/kernels.h"
#include "worker/gpu/nccl_communicator.h"

namespace shard {
namespace {

// Exits with the status's message: a benchmark has no one to return errors to.
void Check(const absl::Status& status) {
  if (!status.ok()) {
    std::fprintf(stderr, "shard-bench-gpu: %s\n", status.ToString().c_str());
    std::exit(1);
  }
}
template <typename T>
T Check(absl::StatusOr<T> value) {
  Check(value.status());
  return std::move(value).value();
}

// The milliseconds of `run` over `iters` repetitions after `warmup`, each between two events on
// `stream`.
bench::Stats EventTimes(cudaStream_t stream, int warmup, int iters,
                        const std::function<void()>& run) {
  CudaEvent start = Check(CudaEvent::Create(true));
  CudaEvent stop = Check(CudaEvent::Create(true));
  return bench::Summarize(bench::CollectRuns(warmup, iters, [&] {
    Check(CudaStatus(cudaEventRecord(start.get(), stream), "cudaEventRecord"));
    run();
    Check(CudaStatus(cudaEventRecord(stop.get(), stream), "cudaEventRecord"));
    Check(CudaStatus(cudaEventSynchronize(stop.get()), "cudaEventSynchronize"));
    float ms = 0;
    Check(CudaStatus(cudaEventElapsedTime(&ms, start.get(), stop.get()), "cudaEventElapsedTime"));
    return static_cast<double>(ms);
  }));
}

bench::Record CopyRecord(cudaStream_t stream, int64_t bytes, int iters) {
  DeviceBuffer src = Check(DeviceBuffer::Allocate(bytes));
  DeviceBuffer dst = Check(DeviceBuffer::Allocate(bytes));
  Check(FillUniform(src.as<float>(), bytes / 4, 1, -1.0f, 1.0f, stream));
  return bench::Record({.op = "copy", .impl = "device to device", .bytes = 2 * bytes,
                        .warmup = 3},
                       EventTimes(stream, 3, iters, [&] {
                         Check(CudaStatus(cudaMemcpyAsync(dst.data(), src.data(), bytes,
                                                          cudaMemcpyDeviceToDevice, stream),
                                          "cudaMemcpyAsync"));
                       }));
}

// NCCL rows: every collective the engine uses, out of place, on `bytes` of fp32 each.
void NcclRows(bench::Report& report, cudaStream_t stream, const std::vector<int64_t>& sizes,
              int iters, double copy_gbps) {
  // At world size 1 rank 0 only publishes the unique id; nobody fetches it.
  const IdExchange exchange{
      [](const std::string&, const std::string&) { return absl::OkStatus(); },
      [](const std::string& key) -> absl::StatusOr<std::string> {
        return absl::InternalError("no peer at world size 1 fetches " + key);
      }};
  NcclOptions options;
  options.compute_stream = stream;
  std::unique_ptr<NcclCommunicator> nccl = Check(NcclCommunicator::Create(0, 1, exchange, options));
  Check(nccl->WaitReady());
  const int64_t largest = *std::max_element(sizes.begin(), sizes.end());
  DeviceBuffer send = Check(DeviceBuffer::Allocate(largest));
  DeviceBuffer recv = Check(DeviceBuffer::Allocate(largest));
  Check(FillUniform(send.as<float>(), largest / 4, 3, -1.0f, 1.0f, stream));
  const std::pair<const char*, std::function<absl::Status(size_t)>> collectives[] = {
      {"all_reduce", [&](size_t n) {
         return nccl->AllReduce(send.data(), recv.data(), n, DataType::kFloat32, ReduceOp::kSum);
       }},
      {"reduce_scatter", [&](size_t n) {
         return nccl->ReduceScatter(send.data(), recv.data(), n, DataType::kFloat32,
                                    ReduceOp::kSum);
       }},
      {"all_gather",
       [&](size_t n) { return nccl->AllGather(send.data(), recv.data(), n, DataType::kFloat32); }},
      {"broadcast", [&](size_t n) { return nccl->Broadcast(recv.data(), n, DataType::kFloat32, 0); }},
  };
  for (const auto& [name, collective] : collectives) {
    // In place (broadcast) NCCL moves nothing at world size 1: only its time is worth a row.
    const bool in_place = std::string(name) == "broadcast";
    for (int64_t bytes : sizes) {
      const size_t count = static_cast<size_t>(bytes / 4);
      // Read + write, as the copy is counted.
      bench::Record record({.op = name,
                            .impl = in_place ? "nccl in place" : "nccl",
                            .bytes = in_place ? 0 : 2 * bytes,
                            .count = static_cast<int64_t>(count),
                            .dtype = "f32",
                            .ranks = 1,
                            .warmup = 3},
                           EventTimes(stream, 3, iters, [&] {
                             Check(collective(count));
                             Check(nccl->OrderComputeAfterCollectives());
                           }));
      report.Add(record.Compare("algbw_gbps", "copy", copy_gbps));
    }
  }
}

// One Adam row: `elements` parameters as tensors of `tensor_elements` each.
void AdamRow(bench::Report& report, cudaStream_t stream, int64_t elements,
             int64_t tensor_elements, DataType model, int iters, double copy_gbps) {
  DeviceBuffer param = Check(DeviceBuffer::Allocate(elements * sizeof(float)));
  DeviceBuffer grad = Check(DeviceBuffer::Allocate(elements * sizeof(float)));
  DeviceBuffer m = Check(DeviceBuffer::Allocate(elements * sizeof(float)));
  DeviceBuffer v = Check(DeviceBuffer::Allocate(elements * sizeof(float)));
  const bool copies = model != DataType::kFloat32;
  DeviceBuffer model_copy = Check(DeviceBuffer::Allocate(copies ? elements * 2 : 0));
  Check(FillUniform(param.as<float>(), elements, 1, -1.0f, 1.0f, stream));
  Check(FillUniform(grad.as<float>(), elements, 2, -1e-2f, 1e-2f, stream));
  Check(FillUniform(m.as<float>(), elements, 3, -1e-3f, 1e-3f, stream));
  Check(FillUniform(v.as<float>(), elements, 4, 1e-8f, 1e-6f, stream));
  std::vector<TensorSlot> slots;
  for (int64_t begin = 0; begin < elements; begin += tensor_elements) {
    TensorSlot slot;
    slot.param = param.as<float>() + begin;
    slot.grad = grad.as<float>() + begin;
    slot.state[0] = m.as<float>() + begin;
    slot.state[1] = v.as<float>() + begin;
    if (copies) slot.model = model_copy.as<char>() + begin * 2;
    slot.count = std::min(tensor_elements, elements - begin);
    slots.push_back(slot);
  }
  const TensorList list = Check(TensorList::Create(slots, model, stream));
  const FusedOptimizer adam(OptimizerConfig{});
  int64_t step = 0;
  std::string impl = std::to_string(slots.size()) + (slots.size() == 1 ? " tensor" : " tensors");
  if (copies) impl += " +" + std::string(DataTypeName(model));
  bench::Record record({.op = "adam",
                        .impl = impl,
                        .bytes = elements * (copies ? 30 : 28),
                        .count = elements,
                        .dtype = "f32",
                        .warmup = 3},
                       EventTimes(stream, 3, iters,
                                  [&] { Check(adam.Step(++step, list, stream)); }));
  report.Add(record.Compare("algbw_gbps", "copy", copy_gbps));
}

void MlpRow(bench::Report& report, cudaStream_t stream, const std::vector<int64_t>& widths,
            int64_t batch, DataType precision, bool tf32, int iters) {
  std::vector<int64_t> sizes;
  int64_t total = 0;
  double flops = 0;
  for (size_t l = 0; l + 1 < widths.size(); ++l) {
    sizes.push_back(widths[l + 1] * widths[l]);
    sizes.push_back(widths[l + 1]);
    total += widths[l + 1] * widths[l] + widths[l + 1];
    // Forward, weight gradient, and (but for the first layer) input gradient products.
    flops += 2.0 * batch * widths[l] * widths[l + 1] * (l == 0 ? 2 : 3);
  }
  const bool narrow = precision != DataType::kFloat32;
  DeviceBuffer master = Check(DeviceBuffer::Allocate(total * sizeof(float)));
  DeviceBuffer model = Check(DeviceBuffer::Allocate(narrow ? total * 2 : 0));
  DeviceBuffer grads = Check(DeviceBuffer::Allocate(total * sizeof(float)));
  DeviceBuffer m = Check(DeviceBuffer::Allocate(total * sizeof(float)));
  DeviceBuffer v = Check(DeviceBuffer::Allocate(total * sizeof(float)));
  DeviceBuffer x = Check(DeviceBuffer::Allocate(batch * widths[0] * sizeof(float)));
  Check(FillUniform(master.as<float>(), total, 5, -0.03f, 0.03f, stream));
  Check(Fill(m.as<float>(), total, 0.0f, stream));
  Check(Fill(v.as<float>(), total, 0.0f, stream));
  Check(FillUniform(x.as<float>(), batch * widths[0], 6, -1.0f, 1.0f, stream));
  if (narrow) Check(Cast(master.data(), DataType::kFloat32, model.data(), precision, total, stream));
  std::vector<int64_t> labels(batch);
  for (int64_t r = 0; r < batch; ++r) labels[r] = (r * 7) % widths.back();
  DeviceBuffer y = Check(DeviceBuffer::Allocate(batch * sizeof(int64_t)));
  Check(CudaStatus(cudaMemcpy(y.data(), labels.data(), batch * sizeof(int64_t),
                              cudaMemcpyHostToDevice),
                   "cudaMemcpy of the labels"));
  std::vector<const void*> params;
  std::vector<float*> grad_views;
  int64_t offset = 0;
  for (int64_t size : sizes) {
    params.push_back(narrow ? static_cast<const void*>(model.as<uint16_t>() + offset)
                            : static_cast<const void*>(master.as<float>() + offset));
    grad_views.push_back(grads.as<float>() + offset);
    offset += size;
  }
  TensorSlot slot;
  slot.param = master.as<float>();
  slot.grad = grads.as<float>();
  slot.state[0] = m.as<float>();
  slot.state[1] = v.as<float>();
  slot.model = narrow ? model.data() : nullptr;
  slot.count = total;
  const TensorList list = Check(TensorList::Create({slot}, precision, stream));
  std::unique_ptr<GpuMlp> mlp = Check(GpuMlp::Create(
      widths, batch, stream, {.precision = precision, .allow_tf32 = tf32}));
  const FusedOptimizer adam(OptimizerConfig{});
  int64_t step = 0;
  bench::Record record({.op = "mlp_step",
                        .impl = std::string(DataTypeName(precision)) + (tf32 ? " tf32" : ""),
                        .count = batch,
                        .dtype = std::string(DataTypeName(precision)),
                        .warmup = 20},
                       EventTimes(stream, 20, iters, [&] {
                         Check(mlp->Forward(params, x.as<float>(), y.as<int64_t>(), batch));
                         Check(mlp->Backward(params, grad_views, 1.0f / batch, [](int) {}));
                         Check(adam.Step(++step, list, stream));
                       }));
  Check(mlp->Loss().status());  // every step's kernels ran without error
  const double ms = record.time_ms();
  report.Add(record.Extra("steps_per_s", 1e3 / ms).Extra("tflops", flops / (ms * 1e-3) / 1e12));
}

}  // namespace
}  // namespace shard

int main(int argc, char** argv) {
  CLI::App app{"shard-bench-gpu: the fused Adam step against a device-to-device copy, MLP "
               "training steps per second, and NCCL's collectives at world size 1, on GPU 0.",
               "shard-bench-gpu"};
  std::vector<int64_t> adam_elements = {100'000'000, 1'000'000'000};
  int64_t tensor_elements = int64_t{1} << 22;
  int64_t copy_bytes = int64_t{2} << 30;
  std::vector<int64_t> widths = {512, 1024, 1024, 64};
  int64_t batch = 256;
  int iters = 20;
  int mlp_iters = 200;
  std::vector<int64_t> nccl_bytes = {4096, int64_t{64} << 20, int64_t{1} << 30};
  app.add_option("--adam-elements", adam_elements, "Adam sizes (parameters)")
      ->delimiter(',')
      ->capture_default_str();
  app.add_option("--tensor-elements", tensor_elements,
                 "elements per tensor in the many-tensor rows")
      ->capture_default_str();
  app.add_option("--copy-bytes", copy_bytes, "bytes of the reference copy")->capture_default_str();
  app.add_option("--widths", widths, "MLP widths")->delimiter(',')->capture_default_str();
  app.add_option("--batch", batch, "MLP batch")->capture_default_str();
  app.add_option("--iters", iters, "timed Adam and copy repetitions")->capture_default_str();
  app.add_option("--mlp-iters", mlp_iters, "timed MLP steps")->capture_default_str();
  app.add_option("--nccl-bytes", nccl_bytes, "bytes per NCCL collective (world size 1)")
      ->delimiter(',')
      ->capture_default_str();
  shard::bench::Output output;
  shard::bench::AddOutputOptions(app, &output);
  if (std::optional<int> exit_code = shard::ParseCommandLine(app, argc, argv)) return *exit_code;

  using shard::Check;
  std::string why;
  if (shard::CudaDeviceCount(&why) == 0) {
    std::fprintf(stderr, "shard-bench-gpu: no CUDA device: %s\n", why.c_str());
    return 1;
  }
  Check(shard::CudaStatus(cudaSetDevice(0), "cudaSetDevice(0)"));
  cudaDeviceProp props;
  Check(shard::CudaStatus(cudaGetDeviceProperties(&props, 0), "cudaGetDeviceProperties"));
  const shard::CudaStream stream = Check(shard::CudaStream::Create());
  shard::bench::Report report("shard-bench-gpu", output);
  report.Note(absl::StrFormat(
      "GPU 0: %s, %d SMs, %.1f GiB; medians of %d (MLP steps: %d); size(B) and GB/s: the bytes "
      "read and written, as the copy's; an NCCL broadcast at world size 1 moves nothing (its "
      "time alone)",
      props.name, props.multiProcessorCount, props.totalGlobalMem / double(int64_t{1} << 30),
      iters, mlp_iters));
  const shard::bench::Record copy = shard::CopyRecord(stream.get(), copy_bytes, iters);
  report.Add(copy);
  const double copy_gbps = *copy.algbw_gbps();
  for (int64_t elements : adam_elements) {
    shard::AdamRow(report, stream.get(), elements, elements, shard::DataType::kFloat32, iters,
                   copy_gbps);
    shard::AdamRow(report, stream.get(), elements, tensor_elements, shard::DataType::kFloat32,
                   iters, copy_gbps);
    shard::AdamRow(report, stream.get(), elements, tensor_elements, shard::DataType::kBFloat16,
                   iters, copy_gbps);
  }
  shard::MlpRow(report, stream.get(), widths, batch, shard::DataType::kFloat32, false, mlp_iters);
  shard::MlpRow(report, stream.get(), widths, batch, shard::DataType::kFloat32, true, mlp_iters);
  shard::MlpRow(report, stream.get(), widths, batch, shard::DataType::kBFloat16, false, mlp_iters);
  shard::MlpRow(report, stream.get(), widths, batch, shard::DataType::kFloat16, false, mlp_iters);
  shard::NcclRows(report, stream.get(), nccl_bytes, iters, copy_gbps);
  return report.Finish() ? 0 : 1;
}
