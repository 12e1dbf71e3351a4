"""Helper for test_distributed.py (not a test): a few Trainer steps, then every rank saves the weights it ends with.

Usage: python distributed_train.py MODEL_DIR OUT_DIR PER_DEVICE_BATCH [fsdp]  (plain, or under torchrun)
Rank 0 also saves the weights it starts from (initial.safetensors); every rank writes its training loss to
loss{rank}.json (a file each: the ranks share one stdout, and their lines interleave mid-line).
"""

import json
import os
import sys

import torch
from safetensors.torch import save_file
from transformers import Trainer, TrainingArguments, set_seed

import encoderstack

model_dir, out_dir, per_device = sys.argv[1], sys.argv[2], int(sys.argv[3])
fsdp = (
    {"fsdp": "full_shard", "fsdp_config": {"transformer_layer_cls_to_wrap": ["EncoderStackLayer"]}}
    if sys.argv[4:] == ["fsdp"]
    else {}
)
rank = int(os.environ.get("RANK", 0))
generator = torch.Generator().manual_seed(0)
rows = []
for i in range(16):
    length = 3 + i % 6
    ids = torch.randint(1000, 2000, (8,), generator=generator)
    mask = (torch.arange(8) < length).long()
    rows.append({"input_ids": ids * mask, "attention_mask": mask, "labels": torch.tensor(i % 3)})
set_seed(0)  # the new classifier head starts the same in every process and in every run
model = encoderstack.EncoderStackForSequenceClassification.from_pretrained(model_dir, num_labels=3)
if rank == 0:
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, os.path.join(out_dir, "initial.safetensors"))
args = TrainingArguments(
    output_dir=out_dir,
    per_device_train_batch_size=per_device,
    max_steps=4,
    learning_rate=0.1,
    optim="sgd",
    lr_scheduler_type="constant",
    report_to=[],
    disable_tqdm=True,
    use_cpu=True,
    save_strategy="no",
    seed=0,
    train_sampling_strategy="sequential",
    **fsdp,
)
result = Trainer(model=model, args=args, train_dataset=rows).train()
with open(os.path.join(out_dir, f"loss{rank}.json"), "w") as file:
    json.dump(result.training_loss, file)
if fsdp:  # the weights are sharded across the ranks: the losses tell what they trained
    sys.exit(0)
save_file({k: v.contiguous() for k, v in model.state_dict().items()}, os.path.join(out_dir, f"rank{rank}.safetensors"))
