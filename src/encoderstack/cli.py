"""The `encoderstack` command line."""

import argparse
import sys
import tempfile


def demo(args) -> int:
    """Build a small model for every placement, save it, reload it through AutoModel and compare outputs."""
    import torch
    from transformers import AutoModel

    from . import EncoderStackConfig, EncoderStackModel

    print(f"{'placement':<10} {'parameters':>10} {'max |reloaded - original|':>26}")
    for placement in ("post", "pre", "sandwich", "deepnorm", "resi_dual"):
        torch.manual_seed(0)
        config = EncoderStackConfig(norm_placement=placement, num_hidden_layers=4, hidden_size=64,
                                    num_attention_heads=4, intermediate_size=128, vocab_size=1000)
        model = EncoderStackModel(config).eval()
        ids = torch.randint(0, 1000, (2, 16))
        with tempfile.TemporaryDirectory() as folder, torch.no_grad():
            model.save_pretrained(folder)
            reloaded = AutoModel.from_pretrained(folder).eval()
            diff = (reloaded(ids).last_hidden_state - model(ids).last_hidden_state).abs().max().item()
        print(f"{placement:<10} {model.num_parameters():>10,} {diff:>26.2e}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="encoderstack", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("demo", help="build, save and reload a model of every placement").set_defaults(run=demo)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
