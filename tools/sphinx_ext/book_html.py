"""Small fixes to the HTML that Jupyter Book 1.x writes, so the site works offline and cleanly.

1. Launch buttons driven by one setting, the repository's URL. Binder and Colab
   buttons need the repository that holds the notebooks; Jupyter Book shows them
   whenever their service URLs are set, and without a repository URL they would
   point at Jupyter Book's own repository. Here ``repository.url`` in
   ``_config.yml`` is the only switch: empty, every launch button is removed;
   set, Binder and Colab buttons appear (the public services by default, unless
   ``launch_buttons`` names others).
2. sphinx-thebe registers its configuration snippet twice, and the second
   ``const THEBE_JS_URL`` is a console error on every page: keep one copy.
(The theme's colour mode, whose empty default its script reports as a console
error, is set in ``_config.yml`` through ``html_context: {default_mode: light}``.)
"""

from __future__ import annotations

BINDER = "https://mybinder.org"
COLAB = "https://colab.research.google.com"


def configure_theme(app, config) -> None:
    opts = dict(config.html_theme_options or {})
    launch = dict(opts.get("launch_buttons") or {})
    if (opts.get("repository_url") or "").strip():
        launch["binderhub_url"] = launch.get("binderhub_url") or BINDER
        launch["colab_url"] = launch.get("colab_url") or COLAB
    else:
        for key in ("binderhub_url", "colab_url", "jupyterhub_url", "deepnote_url"):
            launch[key] = ""
        launch["thebe"] = False
    opts["launch_buttons"] = launch
    config.html_theme_options = opts


def drop_duplicate_scripts(app, pagename, templatename, context, doctree) -> None:
    """Render each inline script body once per page (wraps the template's ``js_tag``)."""
    original = context.get("js_tag")
    if original is None:
        return
    seen: set[str] = set()

    def js_tag(js):
        tag = original(js)
        if "src=" not in tag:
            if tag in seen:
                return ""
            seen.add(tag)
        return tag

    context["js_tag"] = js_tag


def setup(app):
    app.connect("config-inited", configure_theme, priority=900)
    # html-page-context stops at the first handler that returns a template name,
    # so this one runs early; it only wraps the tag writer used at render time.
    app.connect("html-page-context", drop_duplicate_scripts, priority=100)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
