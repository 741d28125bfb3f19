/* libshard: Shard's worker as a C library, for training loops that live outside C++ (the `shard`
 * Python package drives it through ctypes). One process is one rank: it joins the coordinator,
 * registers its model's parameter manifest, and for each generation of the world gets an engine
 * whose flat buffers hold the parameters and gradients; the caller computes forward and backward
 * in place in those buffers, marks gradients ready, and calls the sharded step. Checkpoints,
 * pauses, restores and re-formations are the worker's, as for shard-worker.
 *
 *   shard_join(config, &job)                          blocks until the world is formed
 *   shard_job_set_model(job, manifest_json)           once
 *   [shard_job_set_optimizer(job, json)               once, for a job spec's "torch" optimizer]
 *   while (shard_generation_begin(job, &began, &needs_init) == 0 && began) {
 *     [needs_init: write initial values into the parameters; shard_generation_init(job)]
 *     shard_tensor_dlpack(job, i, grad, &tensor)      views, again when the layout version
 *                                                      changes
 *     while (shard_step_begin(job, &step) == 0 && step >= 0) {
 *       forward; backward into grad, shard_mark_ready(job, i) as each gradient is complete
 *       shard_step(job)                                ABORTED: the generation ended
 *       [or, with the script's own optimizer: shard_step_reduce(job, &update); if update,
 *        update the ranges of shard_updated_ranges; shard_step_finish(job, update)]
 *       shard_step_end(job, loss, &boundary)           CONTINUE, PAUSED or FINISHED
 *     }
 *     shard_generation_end(job, code, message, &path)  after PAUSED, FINISHED (rank 0 exports
 *   }                                                   to path) or an error such as ABORTED
 *   shard_job_close(job)                              began = 0: the job is over
 *
 * Every function but shard_mark_ready returns 0 on success or an error code (absl's status
 * codes: 1 CANCELLED, 3 INVALID_ARGUMENT, 9 FAILED_PRECONDITION, 10 ABORTED, 14 UNAVAILABLE,
 * ...) with the message in shard_last_error(). Calls for one job come from one thread, except
 * shard_mark_ready (any thread, e.g. autograd's) and shard_job_close. No exception crosses this
 * boundary. */
#ifndef SHARD_CAPI_SHARD_H_
#define SHARD_CAPI_SHARD_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct shard_job shard_job;

enum shard_boundary { SHARD_CONTINUE = 0, SHARD_PAUSED = 1, SHARD_FINISHED = 2 };

/* The message of this thread's last failed call (empty after a success), valid until the next
 * call on this thread. */
const char* shard_last_error(void);

/* Joins the coordinator and blocks until the world is formed and this worker holds a rank.
 * `config_json`: {"coordinator": "host:port", "worker_id": "...", "host": "127.0.0.1" (where
 * peers reach this rank), "device": "cpu" or "cuda:N", "backend": "auto" (NCCL on a GPU, Gloo
 * on the host) or "gloo" (on a GPU: staged through host memory, e.g. several ranks sharing one
 * GPU) or "nccl", "transport": "auto" (host memory through shared memory when every rank is on
 * this host, TCP otherwise), "tcp" or "shm", "coordinator_timeout_s": 60,
 * "collective_timeout_s": 60, "log_level": "info", "tls_ca", "tls_cert", "tls_key",
 * "tls_server_name", "job_token_file" (paths)}; only "coordinator" is required. */
int shard_join(const char* config_json, shard_job** job);

/* {"worker_id", "rank", "world_size", "generation", "job": the job spec (protobuf JSON), and
 * while a generation is being trained "next_step" (the 0-based step it runs next) and
 * "optimizer_step" (updates so far)} of the current generation; valid until the next call. */
int shard_job_info(shard_job* job, const char** json);

/* The model's parameters in registration order (common/manifest.h's JSON: {"params": [{"name",
 * "shape", "dtype": "f32", "requires_grad"}]}). Once, before the first generation; every
 * worker of the job must register the same one. */
int shard_job_set_model(shard_job* job, const char* manifest_json);

/* The training script's own optimizer, for a job spec whose optimizer is "torch":
 * {"class": "torch.optim.adamw.AdamW", "state": ["exp_avg", "exp_avg_sq"]}: its class (checked
 * against a checkpoint's on restore) and the names of its state tensors that hold one value per
 * parameter element, which Shard keeps sharded like the parameters (shard_range_dlpack, array
 * k). Once, after shard_job_set_model and before the first generation; every worker must
 * declare the same one. The rest of its state the script hands over at every save
 * (shard_set_extras_callback). */
int shard_job_set_optimizer(shard_job* job, const char* optimizer_json);

/* Waits for the next generation and builds its engine (restoring the coordinator's restore
 * point, or the job's init file). *began = 0 when the job is over. *needs_init = 1 when
 * training starts from scratch: write the initial values into the parameters, then call
 * shard_generation_init, which gives every rank rank 0's. */
int shard_generation_begin(shard_job* job, int* began, int* needs_init);
int shard_generation_init(shard_job* job);

/* *version changes whenever the tensors below may have moved: at the first step (the bucket
 * rebuild) and with every generation. */
int shard_layout_version(shard_job* job, int64_t* version);

/* Where tensor `index`'s values (grad = 0) or gradient (grad = 1) live now, as a DLPack tensor
 * (dlpack/dlpack.h, DLPack 0.6): fp32 in the manifest's shape, on the job's device (kDLCPU, or
 * kDLCUDA with the GPU's index). The caller owns the descriptor and frees it with its deleter
 * (a framework that takes it, such as torch.from_dlpack, does); the memory stays Shard's and is
 * valid until the layout version changes. NOT_FOUND for a frozen tensor's gradient. */
struct DLManagedTensor;
int shard_tensor_dlpack(shard_job* job, int index, int grad, struct DLManagedTensor** tensor);

/* ZeRO stage 3 (the job spec's "zeroStage": 3): each rank keeps only its shard of the trainable
 * parameters, so shard_tensor_dlpack gives them only for frozen tensors. The caller gathers a
 * bucket while it computes with the bucket's parameters (module hooks):
 * shard_param_layout says where each parameter lives, {"buckets": [padded numel of each],
 * "params": [[bucket, offset] by index; bucket -1 for a frozen tensor], "final": whether the
 * buckets were planned from the gradients' ready order} (valid until the layout version
 * changes; at every stage); shard_acquire with grad = 0 gathers bucket `bucket` (prefetching the
 * buckets the previous step acquired next) and gives a 1-D view of its whole parameters, valid
 * until shard_release and the next shard_acquire that needs its slot; with grad = 1 it gives
 * the bucket's zeroed gradient buffer for this step's backward, valid until the bucket's last
 * shard_mark_ready. At other stages shard_acquire gives the bucket's buffers and shard_release
 * does nothing. Every rank must acquire the same buckets in the same order. */
int shard_param_layout(shard_job* job, const char** json);
int shard_acquire(shard_job* job, int bucket, int grad, struct DLManagedTensor** tensor);
int shard_release(shard_job* job, int bucket);
/* Before shard_generation_init: trainable parameter `index`'s initial values (numel floats of
 * host memory) at stage 3, where no rank holds the whole parameter to write them into. */
int shard_set_initial(shard_job* job, int index, const float* values);

/* GPU jobs: the CUDA stream (a cudaStream_t; 0 is the legacy default stream) on which the caller
 * computes with Shard's tensors, e.g. torch.cuda.current_stream().cuda_stream. Every call that
 * reads what the caller wrote (shard_mark_ready, shard_step_end, ...) first makes Shard's work
 * wait for what the caller enqueued there so far, and every call that writes the tensors
 * (shard_generation_begin, shard_step_begin, shard_step, ...) makes the caller's later work
 * there wait for it: CUDA events, no host wait and no device-wide synchronization. Set it before
 * the step's first call; a host job takes only 0. */
int shard_set_stream(shard_job* job, uintptr_t stream);

/* Gives every rank rank 0's values of frozen tensor `index` (requires_grad false in the
 * manifest), e.g. a module buffer such as BatchNorm's running statistics, as DDP's
 * broadcast_buffers does before every forward pass. */
int shard_broadcast(shard_job* job, int index);

/* Starts a step: *step is its 0-based number, or -1 when the job's last step is done; the
 * gradients are zeroed (backward accumulates into them). */
int shard_step_begin(shard_job* job, int64_t* step);
/* Gradient `index` is complete for this step; its bucket reduces once all of its are. */
void shard_mark_ready(shard_job* job, int index);
/* Every gradient of bucket `bucket` (shard_param_layout's) is complete for this step: one call a
 * bucket instead of one a parameter, at stages 0 to 2 once the layout is "final" (before, the
 * first step's ready order of each gradient rebuilds the buckets). Like shard_mark_ready, any
 * thread; what goes wrong is reported by the step. */
void shard_mark_bucket_ready(shard_job* job, int bucket);
/* Waits for the reductions, clips, updates what this rank owns and gathers the parameters. */
int shard_step(shard_job* job);
/* The same in parts, for the script's own optimizer: shard_step_reduce waits for the reductions
 * (the first step of a generation that started from scratch also rebuilds the buckets: the
 * layout version changes) and clips; *update = 0 when this step must not update (loss scaling
 * found an inf or NaN). The script then updates the ranges shard_updated_ranges names and calls
 * shard_step_finish(job, update), which gathers the parameters. */
int shard_step_reduce(shard_job* job, int* update);
int shard_step_finish(shard_job* job, int update);

/* What this rank updates: [{"param": index, "offset": first element, "numel": n, "extras": true
 * when this rank saves the parameter's extras (it holds its first element)}], by bucket; whole
 * parameters in param mode (and at stage 0: everything), ranges in range mode. Valid until the
 * layout version changes. */
int shard_updated_ranges(shard_job* job, const char** json);
/* A 1-D DLPack tensor over range `range` (an index into shard_updated_ranges) of the parameter
 * values (array -1), its reduced gradient (array -2, valid between shard_step_reduce and
 * shard_step_finish) or optimizer state tensor `array` (k >= 0, shard_job_set_optimizer's
 * order): Shard's memory, which its checkpoints and snapshots save and its restores fill. */
int shard_range_dlpack(shard_job* job, int range, int array, struct DLManagedTensor** tensor);

/* Called at every save (checkpoint or memory snapshot) during shard_step_end, on the caller's
 * thread, to hand over what the script's own optimizer keeps besides its per-element state: the
 * callback calls shard_put_extra for each parameter whose extras this rank saves and, on rank 0,
 * for the job's (param -1: param groups, scheduler state), then returns 0 (non-zero fails the
 * save and the step). */
typedef int (*shard_extras_fn)(void* context);
int shard_set_extras_callback(shard_job* job, shard_extras_fn callback, void* context);
int shard_put_extra(shard_job* job, int param, const char* data, size_t size);
/* What the generation's restore read of those: parameter `param`'s extras (-1: the job's), or
 * *data = NULL when it has none (training started from scratch, or the parameter has none). Valid
 * until the generation ends. */
int shard_restored_extra(shard_job* job, int param, const char** data, size_t* size);

/* Consolidation (ZeroRedundancyOptimizer.consolidate_state_dict): parameter `param`'s values
 * (array -1) or optimizer state tensor `array` in full on rank `to` (into `out`, numel floats of
 * host memory; NULL on other ranks). Collective: every rank calls it for the same parameters in
 * the same order; no rank but `to` holds more than one parameter's range at a time. */
int shard_gather_to_rank(shard_job* job, int param, int array, int to, float* out);
/* Parameter `param`'s extras as the rank that saves them (shard_updated_ranges' "extras") has
 * them now (`data`, `size`; other ranks' are ignored) on rank `to` (*out, valid until the next
 * call). Collective. */
int shard_gather_extra(shard_job* job, int param, int to, const char* data, size_t size,
                       const char** out, size_t* out_size);
/* The step boundary: `loss` is the mean loss over this rank's samples. *boundary is one of
 * shard_boundary: go on, paused for a re-formation, or the job's last step done; after either of
 * the latter, end the generation. */
int shard_step_end(shard_job* job, double loss, int* boundary);

/* Hands the generation back to the worker: code 0 after PAUSED or FINISHED, else the error that
 * ended it (ABORTED when the world moved on). After FINISHED this first exports: rank 0 writes
 * output_dir/final.safetensors under the manifest's names (*output_path, empty on other ranks;
 * valid until the next call with this job; output_path may be NULL). The worker then reports
 * the end of training; the next shard_generation_begin says whether the job is over (a rank
 * that died before every rank finished means another generation). A failure of this call (the
 * export's, or code 0 before PAUSED or FINISHED) hands the generation back too, with that
 * error. */
int shard_generation_end(shard_job* job, int code, const char* message, const char** output_path);

/* Leaves the job (if still in it) and frees everything. */
void shard_job_close(shard_job* job);

#ifdef __cplusplus
}
#endif

#endif /* SHARD_CAPI_SHARD_H_ */
