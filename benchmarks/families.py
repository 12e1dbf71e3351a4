"""The BERT family's and the modern encoders' inference: EncoderStack padding-free against each family's own
transformers class (SDPA) on the same weights and batch, as ratios in one run, on full, uniform and text lengths.

    python benchmarks/families.py                  # minilm-sized random models, 32x128 (about 10 minutes on CPU)
    python benchmarks/families.py --quick          # 3 rounds
"""

import common
import torch
from common import encoderstack, transformers

FAMILIES = {  # model_type -> its transformers class
    "bert": "BertModel",
    "roberta": "RobertaModel",
    "xlm-roberta": "XLMRobertaModel",
    "roberta-prelayernorm": "RobertaPreLayerNormModel",
    "xlm-roberta-xl": "XLMRobertaXLModel",
    "electra": "ElectraModel",
    "distilbert": "DistilBertModel",
    "albert": "AlbertModel",
    "modernbert": "ModernBertModel",
    "gte": "GteModel",
    "nomic_bert": "NomicBertModel",
    "jina_embeddings_v3": "JinaEmbeddingsV3Model",
    "eurobert": "EuroBertModel",
    "ultrabert": "UltrabertModel",
    "mpnet": "MPNetModel",
    "deberta-v2": "DebertaV2Model",
    "deberta": "DebertaModel",
}
# DeBERTa-v3's layout (its config's defaults are v2's): disentangled attention over 256 log buckets, the position
# projections shared with the content ones, no absolute positions, no token types
DEBERTA_V3 = {
    "relative_attention": True,
    "position_buckets": 256,
    "pos_att_type": ["p2c", "c2p"],
    "share_att_key": True,
    "norm_rel_ebd": "layer_norm",
    "position_biased_input": False,
    "type_vocab_size": 0,
}
MODERN = ("modernbert", "gte", "nomic_bert", "jina_embeddings_v3", "eurobert", "ultrabert")
MINILM = {"hidden_size": 384, "num_hidden_layers": 6, "num_attention_heads": 12, "intermediate_size": 1536}


def family_pair(family, spec, max_length, folder):
    """A random model of the family's class and EncoderStack's conversion of it (on the fly), both SDPA, eval."""
    fields = {"vocab_size": 30522, **(MINILM if spec == "minilm" else spec)}
    fields["max_position_embeddings"] = max(fields.get("max_position_embeddings", 0), max_length + 2)
    if family in MODERN:  # their default special ids lie beyond a BERT vocabulary: the tokenizer's instead
        fields |= {"pad_token_id": 0, "bos_token_id": 101, "eos_token_id": 102, "cls_token_id": 101}
        fields |= {"sep_token_id": 102}
    extra = {"hidden_dim": fields["intermediate_size"], "embedding_size": fields["hidden_size"] // 2}
    if family == "deberta-v2":  # embeddings as wide as the layers (EncoderStack refuses DeBERTa's embed_proj)
        extra = {**DEBERTA_V3, "embedding_size": fields["hidden_size"]}
    if family == "deberta":  # deberta-base's layout: disentangled attention, no absolute positions
        extra = {"relative_attention": True, "pos_att_type": ["c2p", "p2c"], "position_biased_input": False}
        extra |= {"type_vocab_size": 0, "embedding_size": fields["hidden_size"]}
    config = transformers.AutoConfig.for_model(family, **fields, **extra)
    torch.manual_seed(0)
    reference = getattr(transformers, FAMILIES[family])(config)
    reference.save_pretrained(folder)
    ours = encoderstack.EncoderStackModel.from_pretrained(folder, cpu_kernels=common.CPU_KERNELS)
    return tuple(common.with_backend(model.eval(), "sdpa") for model in (reference, ours))


def main():
    parser = common.common_arguments(__doc__.splitlines()[0], sizes="32x128", models="minilm")
    parser.add_argument("--families", default=",".join(FAMILIES), help="comma-separated model types")
    args = parser.parse_args()
    iterations = args.iterations or (3 if args.quick else 5)
    common.setup(args)
    common.header("families", args.device)
    tokenizer = common.tokenizer()
    rows = []
    for spec in common.parse_models(args.models):
        for batch_size, max_length in common.parse_sizes(args.sizes):
            for family in args.families.split(","):
                with common.scratch_folder() as folder:
                    reference, ours = (
                        common.place(m, args.device) for m in family_pair(family, spec, max_length, folder)
                    )
                for workload in common.WORKLOADS:
                    lengths, width, batch, _ = common.workload_batch(
                        workload, batch_size, max_length, ours.config.vocab_size, tokenizer, args.seed, args.device
                    )
                    with torch.inference_mode():
                        seconds, _ = common.interleave(
                            {"reference": lambda: reference(**batch), "ours": lambda: ours(**batch)},
                            iterations,
                            args.device,
                            64,
                        )
                    ideal = batch_size * width / sum(lengths)
                    speedup = seconds["reference"] / seconds["ours"]
                    rows.append(
                        [
                            common.model_name(spec),
                            family,
                            FAMILIES[family],
                            f"{batch_size}x{width}",
                            workload,
                            f"{sum(lengths) / (batch_size * width):.0%}",
                            f"{speedup:.2f}",
                            f"{ideal:.2f}",
                            f"{speedup / ideal:.0%}",
                        ]
                    )
    print(f"{iterations} interleaved rounds per cell, medians; both SDPA, same weights, same batch")
    print("MPNetModel and the DeBERTa classes run eager whatever is asked (no AttentionInterface); ours SDPA")
    common.print_table(
        rows,
        ["model", "family", "reference", "batch", "lengths", "real", "padding-free speed-up", "ideal", "of ideal"],
    )
    print(f"reproduce: {common.command_line()}")


if __name__ == "__main__":
    main()
