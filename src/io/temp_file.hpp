// The temporary file of an atomic save, and the sweep of those that writers killed outright
// (SIGKILL, power loss) left behind.
//
// A save writes `<dest>.tmp.<pid>.<16 hex digits>` beside its destination and renames it over
// the destination at the end. The file is created exclusively and, before any byte is written
// to it, locked (flock) through a descriptor of its own that the writer holds until the rename
// or the removal: the lock dies with the process, whatever kills it, so an unlocked temporary
// file of a process that no longer exists is garbage.
#ifndef FERRY_SRC_IO_TEMP_FILE_HPP_
#define FERRY_SRC_IO_TEMP_FILE_HPP_

#include <string>

#include "io/io.hpp"

namespace ferry {

struct TempFile {
  File file;         // for writing; its path() is the destination, so messages name that
  std::string path;  // the temporary file's name
  File lock;         // holds the flock; close it after the rename (or the removal)
  std::string dest;  // set by BeginReplace: the file the save replaces
};

// How every save to a local `path` starts: its destination (ReplaceTarget: through a link,
// never over a directory, FIFO or device), the temporary files of dead writers to it swept,
// and its own temporary file created and locked (CreateTempFile).
Result<TempFile> BeginReplace(const std::string& path);

// Creates and locks the temporary file for a save to `dest` (the target ReplaceTarget gave).
// A failure is IoError naming `dest`, with the errno in the message (a missing folder, a full
// disk). Where the file system has no locks, the file is created unlocked.
Result<TempFile> CreateTempFile(const std::string& dest);

// Removes the temporary files of saves to `dest` whose writers are gone: named as
// CreateTempFile names them, regular files, unlocked, of a process id that does not exist (in
// this process's view), and holding data (an empty one only when over a minute old, as a
// writer that has just created its file locks it before writing to it). Best effort: what
// cannot be examined or removed stays.
void SweepStaleTemps(const std::string& dest);

}  // namespace ferry

#endif  // FERRY_SRC_IO_TEMP_FILE_HPP_
