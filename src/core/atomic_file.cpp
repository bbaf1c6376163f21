#include "core/atomic_file.h"

#include <fcntl.h>
#include <ftw.h>
#include <stdio.h>
#include <unistd.h>

#include <sys/stat.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/error.h"

namespace mhla {

namespace fs = std::filesystem;

void fsync_directory(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_DIRECTORY);
  if (fd < 0) return;
  ::fsync(fd);
  ::close(fd);
}

void remove_tree(const std::string& path) {
  struct stat info {};
  if (::lstat(path.c_str(), &info) != 0) return;
  auto remove_entry = [](const char* entry, const struct stat*, int, struct FTW*) {
    return ::remove(entry) == 0 ? 0 : -1;
  };
  if (::nftw(path.c_str(), remove_entry, 16, FTW_DEPTH | FTW_PHYS) != 0) {
    fail("{}: cannot remove ({})", path, std::strerror(errno));
  }
}

void write_file_atomic(const std::string& path, std::string_view contents) {
  const fs::path target(path);
  const fs::path folder = target.has_parent_path() ? target.parent_path() : fs::path(".");
  fs::create_directories(folder);
  const std::string temp = (folder / ("." + target.filename().string() + ".tmp-" +
                                      std::to_string(::getpid())))
                               .string();
  int fd = ::open(temp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) fail("{}: cannot write ({})", temp, std::strerror(errno));
  size_t written = 0;
  while (written < contents.size()) {
    ssize_t n = ::write(fd, contents.data() + written, contents.size() - written);
    if (n < 0) {
      if (errno == EINTR) continue;
      const int err = errno;
      ::close(fd);
      ::unlink(temp.c_str());
      fail("{}: write failed ({})", temp, std::strerror(err));
    }
    written += static_cast<size_t>(n);
  }
  if (::fsync(fd) != 0 || ::close(fd) != 0) {
    const int err = errno;
    ::unlink(temp.c_str());
    fail("{}: fsync failed ({})", temp, std::strerror(err));
  }
  if (::rename(temp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    ::unlink(temp.c_str());
    fail("{}: rename failed ({})", path, std::strerror(err));
  }
  fsync_directory(folder.string());
}

void replace_directory_atomic(const std::string& staging, const std::string& target) {
  const fs::path parent = fs::path(target).parent_path();
  if (fs::exists(target)) {
    if (::renameat2(AT_FDCWD, staging.c_str(), AT_FDCWD, target.c_str(), RENAME_EXCHANGE) != 0) {
      fail("{}: cannot swap in the new checkpoint ({})", target, std::strerror(errno));
    }
    remove_tree(staging);  // now holds the previous contents
  } else if (::rename(staging.c_str(), target.c_str()) != 0) {
    fail("{}: cannot move the new checkpoint into place ({})", target, std::strerror(errno));
  }
  fsync_directory(parent.string());
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("{}: cannot open", path);
  std::ostringstream buffer;
  buffer << in.rdbuf();
  return buffer.str();
}

}  // namespace mhla
