// Record<T>: binds a plain C++ struct as a Python class whose fields are attributes, with a
// keyword constructor, repr, equality and pickling, so that plan types read like dataclasses:
//
//   Record<Sample>(m, "Sample", "A document.")
//       .Field("id", &Sample::id, "index into the dataset")
//       .Field("length", &Sample::length, "tokens")
//       .Done();
//   # Python: Sample(id=3, length=4096) == Sample(id=3, length=4096)
//
// List fields (std::vector) are copied in and out: assign a new list rather than appending
// to the returned one. Struct fields (PlannerConfig.shape) are references and edit in place.
#ifndef SPARSEBALANCE_CLIENT_PYTHON_RECORD_H_
#define SPARSEBALANCE_CLIENT_PYTHON_RECORD_H_

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace sparsebalance {
namespace python {

namespace py = pybind11;

template <typename T>
class Record {
 public:
  Record(py::module_& m, const char* name, const char* doc)
      : cls_(m, name, doc), state_(std::make_shared<State>()) {
    state_->name = name;
  }

  // A read-write attribute. `secret` fields (tokens, keys) show as '***' in repr.
  template <typename F>
  Record& Field(const char* name, F T::*member, const char* doc, bool secret = false) {
    cls_.def_readwrite(name, member, doc);
    state_->setters[name] = [member](T& t, py::handle value) {
      if constexpr (std::is_enum_v<F>) {
        // A name the enum does not know: let its constructor raise its own error (which lists
        // the valid names) instead of a bare cast failure.
        if (py::isinstance<py::str>(value)) {
          t.*member = py::type::of<F>()(value).template cast<F>();
          return;
        }
      }
      t.*member = value.cast<F>();
    };
    state_->fields.push_back({name, secret});
    return *this;
  }

  // A read-write attribute whose Python form is not its C++ type's own conversion:
  // get(const T&) -> py::object and set(T&, py::handle), the latter also used by the keyword
  // constructor.
  template <typename Get, typename Set>
  Record& Property(const char* name, Get get, Set set, const char* doc) {
    cls_.def_property(
        name, [get](const T& t) { return get(t); }, [set](T& t, py::handle v) { set(t, v); }, doc);
    state_->setters[name] = set;
    state_->fields.push_back({name, false});
    return *this;
  }

  template <typename... Extra>
  Record& Def(const char* name, Extra&&... extra) {
    cls_.def(name, std::forward<Extra>(extra)...);
    return *this;
  }

  py::class_<T>& Done() {
    std::shared_ptr<State> state = state_;
    cls_.def(py::init([state](const py::kwargs& kwargs) { return state->Make(kwargs); }),
             ("Keyword arguments set fields; the others keep their defaults. Fields: " +
              state->FieldList() + ".")
                 .c_str());
    cls_.def("__repr__", [state](py::handle self) { return state->Repr(self); });
    cls_.def("__eq__", [state](py::handle self, py::handle other) -> py::object {
      if (!py::isinstance(other, py::type::of(self)))
        return py::reinterpret_borrow<py::object>(Py_NotImplemented);
      for (const FieldInfo& f : state->fields) {
        if (!self.attr(f.name.c_str()).equal(other.attr(f.name.c_str()))) return py::bool_(false);
      }
      return py::bool_(true);
    });
    cls_.attr("__hash__") = py::none();
    cls_.def(
        "to_dict",
        [state](py::handle self) {
          py::dict d;
          for (const FieldInfo& f : state->fields) d[f.name.c_str()] = self.attr(f.name.c_str());
          return d;
        },
        "The fields as a dict (nested records stay objects).");
    cls_.def(py::pickle(
        [state](py::handle self) {
          py::dict d;
          for (const FieldInfo& f : state->fields) d[f.name.c_str()] = self.attr(f.name.c_str());
          return d;
        },
        [state](const py::dict& d) { return state->Make(d); }));
    cls_.attr("_fields") = [&] {
      py::tuple names(state->fields.size());
      for (size_t i = 0; i < state->fields.size(); ++i) names[i] = py::str(state->fields[i].name);
      return names;
    }();
    return cls_;
  }

 private:
  struct FieldInfo {
    std::string name;
    bool secret;
  };
  struct State {
    std::string name;
    std::vector<FieldInfo> fields;
    std::map<std::string, std::function<void(T&, py::handle)>> setters;

    T Make(const py::dict& values) const {
      T t;
      for (auto item : values) {
        const std::string key = py::cast<std::string>(item.first);
        auto it = setters.find(key);
        if (it == setters.end()) {
          throw py::type_error(name + "(): unknown field '" + key + "'; fields: " + FieldList());
        }
        try {
          it->second(t, item.second);
        } catch (const py::cast_error&) {
          throw py::type_error(name + "(): field '" + key + "' cannot take " +
                               py::repr(item.second).cast<std::string>());
        }
      }
      return t;
    }
    std::string FieldList() const {
      std::string out;
      for (const FieldInfo& f : fields) out += (out.empty() ? "" : ", ") + f.name;
      return out;
    }
    std::string Repr(py::handle self) const {
      std::string out = name + "(";
      for (size_t i = 0; i < fields.size(); ++i) {
        py::object value = self.attr(fields[i].name.c_str());
        std::string text = py::repr(value).cast<std::string>();
        if (fields[i].secret && py::len(value) > 0) text = "'***'";
        out += (i ? ", " : "") + fields[i].name + "=" + text;
      }
      return out + ")";
    }
  };

  py::class_<T> cls_;
  std::shared_ptr<State> state_;
};

}  // namespace python
}  // namespace sparsebalance

#endif  // SPARSEBALANCE_CLIENT_PYTHON_RECORD_H_
