"""The launchers' config check: load CONFIG with its `--config.*` overrides as `train` loads them, print the
checkpoint path it trains (`model.path`, on the last line), or print one line naming what is wrong and exit 2.

    python launch/config_model_path.py LAUNCHER_NAME CONFIG [--config.FIELD=VALUE ...]

Run once before a launcher starts anything (a server, N processes), so a bad config or override is one line,
not one per process or an error after the rollout server loaded its model.
"""

import sys


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print("usage: python launch/config_model_path.py LAUNCHER_NAME CONFIG [--config.FIELD=VALUE ...]",
              file=sys.stderr)
        return 2
    me, config, rest = argv[0], argv[1], argv[2:]
    try:
        from jaxrl_mismatch.train.config_overrides import load_config, parse_overrides

        path = load_config(config, parse_overrides(rest, me)).model.path
    except Exception as e:  # noqa: BLE001 - the launcher's one line, naming the config
        print(_one_line(me, config, e), file=sys.stderr)
        return 2
    print(path)
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
