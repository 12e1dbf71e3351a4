"""`encoderstack card` and `encoderstack push`: the model card and the Hub push of `hub_card` and `hub`."""

from encoderstack_cli import COMMANDS

from ..hub import push_folder
from ..hub_card import write_card


def card_command(args) -> int:
    print(f"wrote {write_card(args.folder)}")
    return 0


def push_command(args) -> int:
    commit = push_folder(
        args.folder,
        args.repo_id,
        private=args.private,
        revision=args.revision,
        commit_message=args.commit_message,
        token=args.token,
    )
    print(f"pushed {args.folder} -> {commit.commit_url}")
    return 0


def add_hub_commands(commands) -> None:
    """`encoderstack card` and `encoderstack push`, on the CLI's subparsers."""
    card = commands.add_parser("card", help=COMMANDS["card"])
    card.add_argument("folder", metavar="DIR", help="EncoderStack folder (its README.md is rewritten)")
    card.set_defaults(run=card_command)

    push = commands.add_parser("push", help=COMMANDS["push"])
    push.add_argument("folder", metavar="DIR", help="EncoderStack folder")
    push.add_argument("repo_id", metavar="REPO_ID", help="the Hub repository, namespace/name (created if missing)")
    push.add_argument(
        "--private", action="store_true", help="create the repository private (an existing one keeps its visibility)"
    )
    push.add_argument("--revision", metavar="R", help="branch to commit to, created if missing (default: main)")
    push.add_argument(
        "--commit-message", metavar="M", help="the commit's message (default: 'Upload NAME', NAME the folder's)"
    )
    push.add_argument("--token", metavar="T", help="Hub token (default: HF_TOKEN, or the one `hf auth login` saved)")
    push.set_defaults(run=push_command)
