"""mcd_helpers.tables: the Markdown table and the names of metrics and methods."""

from mcd_helpers.tables import markdown_table, method_label


def test_markdown_table():
    assert (
        markdown_table(["a", "b"], [[1, 2.5], ["x", None]], "lr")
        == "| a | b |\n| --- | ---: |\n| 1 | 2.5 |\n| x | None |"
    )
    assert markdown_table(["a"], []) == "| a |\n| --- |"


def test_method_labels_name_the_network_a_score_comes_from():
    assert method_label("odin") == "ODIN (pre-trained)"
    assert method_label("mcd", "concat") == "MCD (concat)"
