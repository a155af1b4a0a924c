"""`python -m cutp verify-data DIR` and `--verify-data` (issue 43): bytes overwritten in the middle
of a shard are found by its digest and named with the fix; intact data passes; `verify_data`
without prepared data is refused by name. `python -m cutp` lists its commands."""
import shutil

import pytest

from cutp.__main__ import COMMANDS
from cutp.__main__ import main as cutp_main
from cutp.data.shards import HEADER_BYTES
from cutp.runtime.errors import ConfigError
from cutp.train.config import check_prepared_data, derive_run_config
from cutp.train.settings import flag_of


def test_intact_data_passes_and_a_changed_shard_is_named_with_the_fix(prepared, tmp_path, capsys):
    assert cutp_main(["verify-data", str(prepared)]) == 0
    assert "every digest matches meta.json" in capsys.readouterr().out
    data = tmp_path / "data"
    shutil.copytree(prepared, data)
    shard = data / "train_000001.bin"
    with open(shard, "r+b") as f:  # bytes overwritten in the middle, ids still within the vocabulary
        f.seek(HEADER_BYTES + 2000)
        f.write(bytes([65, 0] * 50))
    assert cutp_main(["verify-data", str(data)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"verify-data: {shard}: its blake2b digest differs from meta.json's (the shard was changed after "
                   "prepare-data)",
                   f"verify-data: error: 1 of {len(list(data.glob('*.bin')))} shard(s) damaged in {data}; prepare "
                   f"the data again (python -m cutp prepare-data INPUTS --tokenizer ... --out {data} --overwrite)"]
    # --verify-data: the same check before training, one line
    cfg = derive_run_config({"preset": "tiny", "device": "cpu", "data": str(data), "verify_data": True}, 1, 1)
    with pytest.raises(ConfigError, match=rf"^{shard}: its blake2b digest differs .*; prepare the data again"):
        check_prepared_data(cfg.data)
    check_prepared_data(str(prepared))
    with pytest.raises(ConfigError) as e:
        derive_run_config({"preset": "tiny", "device": "cpu", "verify_data": True}, 1, 1)
    assert e.value.render(flag_of) == ("--verify-data checks the digests of a directory written by python -m cutp "
                                       "prepare-data, and --data is not given (the embedded corpus): omit --verify-data")


def test_python_m_cutp_lists_its_commands_one_line_each(capsys):
    assert cutp_main([]) == 0 and cutp_main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in ("info", "plan", "bench", "prepare-data", "verify-data"):
        assert name in COMMANDS
        assert any(line.split()[:1] == [name] and len(line.split()) > 2 for line in out.splitlines()), name
    assert cutp_main(["bogus"]) == 2
    assert "unknown command 'bogus'" in capsys.readouterr().err
