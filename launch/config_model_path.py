"""The launchers' config check: load CONFIG with its `--config.*` overrides as `train` loads them, print the
checkpoint path it trains (`model.path`, on the last line), or print one line naming what is wrong and exit 2.

    python launch/config_model_path.py [--fields F1,F2,...] LAUNCHER_NAME CONFIG [--config.FIELD=VALUE ...]

Run once before a launcher starts anything (a server, N processes), so a bad config or override is one line,
not one per process or an error after the rollout server loaded its model. With `--fields`, the last line holds
those fields' values instead, tab-separated (a launcher that starts the rollout server reads its engine and dtype
from the config, as `train`'s own server does).
"""

import sys


def main(argv: list[str]) -> int:
    fields = ["model.path"]
    if argv[:1] == ["--fields"] and len(argv) > 1:
        fields, argv = argv[1].split(","), argv[2:]
    if len(argv) < 2:
        print("usage: python launch/config_model_path.py [--fields F1,F2] LAUNCHER_NAME CONFIG "
              "[--config.FIELD=VALUE ...]", file=sys.stderr)
        return 2
    me, config, rest = argv[0], argv[1], argv[2:]
    try:
        from jaxrl_mismatch.train.config_overrides import load_config, parse_overrides

        c = load_config(config, parse_overrides(rest, me))
        values = []
        for field in fields:
            node = c
            for part in field.split("."):
                node = node[part]
            values.append(str(node))
    except Exception as e:  # noqa: BLE001 - the launcher's one line, naming the config
        print(_one_line(me, config, e), file=sys.stderr)
        return 2
    print("\t".join(values))
    return 0


def _one_line(me: str, config: str, e: Exception) -> str:
    """`LAUNCHER: ...`, naming the config file unless the message already names a `--config` flag or override."""
    message = " ".join(str(e).split())
    if message.startswith(me + ":"):
        return message
    if message.startswith("--config"):
        return f"{me}: {message}"
    return f"{me}: --config {config}: {message}"


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
