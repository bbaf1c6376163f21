"""The kernel switches (MHLA_* environment variables) that the sources read, the list that run
logs and bench lines check names against (src/core/environment.cpp), and the README's table of
them: the three must name the same switches, so a new switch is recorded in run folders, and a
reader can look every one up."""
import os
import re
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Variables that are paths, not kernel switches (environment.cpp leaves them out of the logs).
PATHS = {"MHLA_DATA_DIR", "MHLA_BIN", "MHLA_TESTS_BIN"}
# How the sources read a switch: getenv, environment_switch or the pipelined passes' CTA switch,
# always with the name as a literal.
READ = re.compile(r'(?:getenv|environment_switch|one_state_unless_three_ctas)\(\s*"(MHLA_[A-Z0-9_]+)"')


def switches_read():
    names = set()
    for top in ("src", "kernels"):
        for folder, _, files in os.walk(os.path.join(ROOT, top)):
            for name in files:
                if name.endswith((".cpp", ".h", ".cu", ".cuh")):
                    with open(os.path.join(folder, name), encoding="utf-8") as source:
                        names.update(READ.findall(source.read()))
    return names - PATHS


def switches_listed():
    with open(os.path.join(ROOT, "src", "core", "environment.cpp"), encoding="utf-8") as source:
        text = source.read()
    body = text[text.index("const std::vector<KernelSwitch>& kernel_switches()"):]
    body = body[:body.index("};")]
    return re.findall(r'\{"(MHLA_[A-Z0-9_]+)", "[^"]+"\}', body)


def switch_values():
    """name -> the values environment.cpp says the switch reads ("<count>" / "<passes>" kept)."""
    with open(os.path.join(ROOT, "src", "core", "environment.cpp"), encoding="utf-8") as source:
        text = source.read()
    body = text[text.index("const std::vector<KernelSwitch>& kernel_switches()"):]
    body = body[:body.index("};")]
    return {name: values.split("|")
            for name, values in re.findall(r'\{"(MHLA_[A-Z0-9_]+)", "([^"]+)"\}', body)}


def readme_table_rows():
    """name -> the backticked values of its README row's values column."""
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as readme:
        text = readme.read()
    section = text[text.index("\n## Kernel switches"):]
    section = section[:section.index("\n## ", 1)]
    rows = {}
    for name, values in re.findall(r"^\| `(MHLA_[A-Z0-9_]+)` \| ([^|]*) \|", section, flags=re.M):
        rows[name] = re.findall(r"`([^`]+)`", values)
    return rows


def readme_table_switches():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as readme:
        text = readme.read()
    section = text[text.index("\n## Kernel switches"):]
    section = section[:section.index("\n## ", 1)]
    return re.findall(r"^\| `(MHLA_[A-Z0-9_]+)", section, flags=re.M)


class KernelSwitches(unittest.TestCase):
    def test_every_switch_read_is_listed(self):
        read, listed = switches_read(), set(switches_listed())
        self.assertTrue(read, "no switch found in the sources: the pattern is stale")
        self.assertEqual(sorted(read - listed), [], "read by the sources but not in environment.cpp")
        self.assertEqual(sorted(listed - read), [], "in environment.cpp but read by no source")

    def test_list_is_sorted_without_repeats(self):
        listed = switches_listed()
        self.assertEqual(listed, sorted(set(listed)))

    def test_readme_table_names_every_switch_once(self):
        table = readme_table_switches()
        self.assertEqual(len(table), len(set(table)), "a switch has two rows")
        self.assertEqual(sorted(set(table) ^ set(switches_listed())), [],
                         "README's switch table and environment.cpp differ")


class SwitchValues(unittest.TestCase):
    def test_readme_values_are_values_the_switch_reads(self):
        values = switch_values()
        for name, shown in readme_table_rows().items():
            read = values[name]
            if read in (["<count>"], ["<passes>"]):
                continue  # described in words
            for value in shown:
                self.assertIn(value, read, f"{name}: README shows {value}, the code reads {read}")
            self.assertTrue(shown, f"{name}: no value in the README row")


if __name__ == "__main__":
    unittest.main()
