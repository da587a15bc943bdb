"""The HTML fixes of tools/sphinx_ext/book_html.py: launch buttons follow one setting."""

import sys
from pathlib import Path
from types import SimpleNamespace

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools" / "sphinx_ext"))
import book_html  # noqa: E402


def theme(repository_url):
    return SimpleNamespace(html_theme_options={
        "repository_url": repository_url,
        "launch_buttons": {"binderhub_url": "", "colab_url": "", "thebe": True}})


def test_no_repository_url_means_no_launch_button_at_all():
    config = theme("")
    config.html_theme_options["launch_buttons"]["binderhub_url"] = "https://example.org/binder"
    book_html.configure_theme(None, config)
    launch = config.html_theme_options["launch_buttons"]
    assert launch["binderhub_url"] == launch["colab_url"] == launch["jupyterhub_url"] == ""
    assert launch["thebe"] is False


def test_a_repository_url_turns_on_binder_and_colab():
    config = theme("https://github.com/someone/book")
    book_html.configure_theme(None, config)
    launch = config.html_theme_options["launch_buttons"]
    assert launch["binderhub_url"] == book_html.BINDER and launch["colab_url"] == book_html.COLAB


def test_the_book_ships_with_the_repository_url_unset():
    config = yaml.safe_load((ROOT / "_config.yml").read_text())
    assert config["repository"]["url"] == ""


def test_inline_scripts_are_written_once_per_page():
    context = {"js_tag": lambda js: js}
    book_html.drop_duplicate_scripts(None, "p", "t", context, None)
    tags = [context["js_tag"](t) for t in ["<script>a</script>", '<script src="x.js"></script>',
                                           "<script>a</script>", '<script src="x.js"></script>']]
    assert tags == ["<script>a</script>", '<script src="x.js"></script>', "", '<script src="x.js"></script>']
