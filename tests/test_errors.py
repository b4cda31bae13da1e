"""One line per job for a user's error and for Ctrl-C (eagle3prep.errors.one_line_errors)."""

import pytest

from eagle3prep.errors import UserError, one_line_errors


def test_user_error_is_one_line_and_exit_1(capsys):
    with pytest.raises(SystemExit) as e, one_line_errors():
        raise UserError("data.sources: 'x' does not exist")
    assert e.value.code == 1 and capsys.readouterr().err == "error: data.sources: 'x' does not exist\n"


def test_ctrl_c_is_one_line_not_a_traceback(capsys):
    # Was a KeyboardInterrupt traceback per running job (~100 lines with torch's frames).
    with pytest.raises(SystemExit) as e, one_line_errors():
        raise KeyboardInterrupt
    assert e.value.code == 130
    assert capsys.readouterr().err == (
        "interrupted (Ctrl-C): this job's outputs are incomplete; the same command redoes it\n"
    )
