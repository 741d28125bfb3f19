"""torch.optim.Adam(fused=True) on the sizes shard-bench-gpu times, for the comparison in
docs/gpu.md: same byte count (7 x 4 bytes per fp32 element), CUDA events, warm-up, medians, and
a device-to-device copy measured in the same run. Run by scripts/gpu-test.sh where PyTorch is
installed; prints rows of the benchmark's Adam table."""
import argparse
import statistics

import torch


def median_ms(fn, warmup, iters):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--adam-elements", default="100000000,1000000000")
    parser.add_argument("--tensor-elements", type=int, default=1 << 22)
    parser.add_argument("--copy-bytes", type=int, default=2 << 30)
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()

    src = torch.rand(args.copy_bytes // 4, device="cuda")
    dst = torch.empty_like(src)
    copy_ms = median_ms(lambda: dst.copy_(src), 3, args.iters)
    copy_gbps = 2 * args.copy_bytes / (copy_ms * 1e-3) / 1e9
    del src, dst
    print(f"# torch {torch.__version__}, {torch.cuda.get_device_name()}; device-to-device copy "
          f"{copy_gbps:.0f} GB/s (read + write)")
    for elements in (int(e) for e in args.adam_elements.split(",")):
        for tensor_elements in (elements, args.tensor_elements):
            sizes = [min(tensor_elements, elements - b) for b in range(0, elements, tensor_elements)]
            params = [torch.nn.Parameter(torch.rand(n, device="cuda") * 2 - 1) for n in sizes]
            for p in params:
                p.grad = (torch.rand_like(p) - 0.5) * 2e-2
            optimizer = torch.optim.Adam(params, lr=1e-3, fused=True)
            ms = median_ms(optimizer.step, 3, args.iters)
            gbps = 28 * elements / (ms * 1e-3) / 1e9
            print(f"| torch fused adam | {elements} | {len(params)} | - | {ms:.3f} | {gbps:.0f} "
                  f"| {gbps / copy_gbps:.2f} |")
            del params, optimizer
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
