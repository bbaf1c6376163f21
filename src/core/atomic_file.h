#pragma once
// Writes that never leave a half-written file behind: data goes to a temporary name in the same
// folder, is fsynced, then renamed over the target (and the folder fsynced).
#include <string>
#include <string_view>

namespace mhla {

void write_file_atomic(const std::string& path, std::string_view contents);
// Makes `staging` (a complete folder) become `target`: an atomic exchange when `target` exists
// (the old contents are removed afterwards), a plain rename otherwise.
void replace_directory_atomic(const std::string& staging, const std::string& target);
void fsync_directory(const std::string& path);
// Removes a file or a folder tree (no error if absent). Used instead of std::filesystem::
// remove_all, whose copy exported by libtorch.so crashes on some machines.
void remove_tree(const std::string& path);
std::string read_file(const std::string& path);

}  // namespace mhla
