# Sphinx configuration of the site (docs/build_site.py assembles the sources in build/site-src/).
project = "Concatenate or forward twice? MCD out-of-distribution detection"
author = "The mcd-concat-vs-separate contributors"
extensions = ["myst_nb"]
root_doc = "index"
exclude_patterns = ["_build", "**.ipynb_checkpoints"]
nb_execution_mode = "off"  # the notebooks arrive executed (quick mode) by make test
myst_enable_extensions = ["dollarmath", "amsmath"]
myst_heading_anchors = 3  # README and docs link to #section anchors
html_theme = "sphinx_book_theme"
html_title = "MCD: concatenate or forward twice?"
html_theme_options = {"show_toc_level": 2, "navigation_with_keys": False}
# without it a first visit logs "Got invalid theme mode" (pydata-sphinx-theme.js)
html_context = {"default_mode": "auto"}
html_show_sourcelink = False
