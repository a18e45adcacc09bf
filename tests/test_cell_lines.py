"""A rank counts a cell's lines as the notebook's editor does (core/cell_lines.py, pure):
where a cell's code starts in the notebook cell, and the label that carries it."""

from __future__ import annotations

from infini_notebook.core import cell_lines


def test_a_cell_magics_body_starts_on_the_line_after_the_magic_line():
    assert cell_lines.first_line("%%dist\nx = 1\n1/0", "x = 1\n1/0\n") == 2
    assert cell_lines.first_line("\n\n%%dist --ranks 0\nx = 1", "x = 1") == 4  # blank lines
    # IPython passes a blank first body line on; the rank adds the blank lines it drops
    assert cell_lines.first_line("%%dist\n\n1/0", "\n1/0") == 2
    assert cell_lines.leading_blank_lines("\n  \n1/0") == 2
    assert cell_lines.leading_blank_lines("1/0\n\n") == 0


def test_code_that_is_not_the_cells_tail_counts_from_its_own_first_line():
    assert cell_lines.first_line("x = 1\n1/0", "x = 1\n1/0") == 1  # auto mode: the cell
    assert cell_lines.first_line("\n\nx = 1", "x = 1") == 3
    assert cell_lines.first_line("s.run('x = 1')", "x = 1") == 1  # the API from a cell
    assert cell_lines.first_line("a = 2\nx = 1", "x = 1") == 1  # a tail after code
    assert cell_lines.first_line("%%dist\n", "") == 1


def test_the_label_says_the_first_line_only_when_it_is_not_1():
    assert cell_lines.label("In[7]", 1) == "In[7]"
    assert cell_lines.label("In[7]", 2) == "In[7]:2"
    assert cell_lines.label("", 2) == ""
    assert cell_lines.parse("In[7]:2") == (7, 2)
    assert cell_lines.parse("In[7]") == (7, 1)
    assert cell_lines.parse("profile stop") is None
