"""A script that starts ranks at module level, without ``if __name__ == "__main__":``, gets one
clear error (multiprocessing re-runs the script in every rank it starts)."""

import subprocess
import sys
import textwrap


def test_ranks_at_module_level_without_main_guard_is_one_clear_error(tmp_path):
    script = tmp_path / "noguard.py"
    script.write_text(textwrap.dedent("""
        import os
        from pipecomm.lab.networks import launch

        def f():
            return os.getpid()

        with launch.Ranks(2) as ranks:
            print(ranks.run(f))
    """))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert out.count("UnguardedMainError:") == 1, out
    assert 'if __name__ == "__main__":' in out and str(script) in out
    assert "bootstrapping phase" not in out  # multiprocessing's own error is not shown
