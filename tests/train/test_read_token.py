"""The trainer reads an external server's token as `serve` does (`rollout.protocol.token_from_bytes`): a token file
that is not UTF-8 was a UnicodeDecodeError traceback, and a non-ASCII token failed only at the first push
("Invalid metadata"). Both are one ConfigError naming the field or variable, without the token's bytes."""

from __future__ import annotations

import pytest

from jaxrl_mismatch.train.config import ConfigError
from jaxrl_mismatch.train.loop import _read_token


@pytest.mark.parametrize("raw, offset", [(b"ab\xffcd\n", 2), ("tökén\n".encode(), 1), (b"a\tb", 1)])
def test_a_token_file_that_is_not_printable_ascii_is_one_error_naming_the_field(tmp_path, raw, offset):
    path = tmp_path / "token"
    path.write_bytes(raw)
    with pytest.raises(ConfigError, match=rf"^config.rollout.token_file: {path}: the token must be printable ASCII "
                                          rf"\(it travels as gRPC metadata\); the byte at offset {offset} is not"):
        _read_token(str(path))


def test_the_token_variable_is_checked_alike_and_a_good_token_is_read(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXRL_ROLLOUT_TOKEN", "s3cr\u00e9t")
    with pytest.raises(ConfigError, match=r"^\$JAXRL_ROLLOUT_TOKEN \(config.rollout.token_file is unset\): the token "
                                          r"must be printable ASCII .* offset 4 is not") as e:
        _read_token("")
    assert "s3cr" not in str(e.value)
    monkeypatch.setenv("JAXRL_ROLLOUT_TOKEN", "  ")
    with pytest.raises(ConfigError, match=r"needs the shared token for weight pushes"):
        _read_token("")
    path = tmp_path / "token"
    path.write_text("  t0ken-1 \n")
    assert _read_token(str(path)) == "t0ken-1"
