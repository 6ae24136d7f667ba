"""Fixtures shared by test modules: the uninterrupted demo run that resume tests compare with."""

import pytest

from tests.launcher.harness import demo_config, launch, read_metrics


@pytest.fixture(scope="session")
def uninterrupted(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("uninterrupted")
    config = demo_config(tmp)
    result = launch(4, config)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return dict(tmp=tmp, config=config, out=tmp / "run", result=result, metrics=read_metrics(tmp / "run"))
